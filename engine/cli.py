"""`gguf-prefill`: one function per verb. Bad input prints one line on stderr and exits 2.

`serve` is the server's own command line (server.main.main), imported only when it runs:
the engine does not import the server package otherwise.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import warnings

from engine.errors import GGUFError, UsageError, printable

PROG = "gguf-prefill"
MAX_ERROR_CHARS = 2000            # an error line, whole (file-supplied parts are cut shorter)
MAX_TOKEN_ID = (1 << 31) - 1      # ids are int32 in every backend
SYNTH_SHAPES = ("tiny", "tiny-qwen2", "llama2-7b", "llama3-8b", "qwen2-7b", "qwen2.5-1.5b")


def version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version as dist_version

        return dist_version("gguf-prefill")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _model_path(args) -> str:
    from engine.tools.fetch import resolve_model

    return resolve_model(args.model)


def _text(value: str, flag: str) -> str:
    """A text argument, which must be valid UTF-8 (undecodable argv bytes arrive as surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = value[e.start]
        shown = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"U+{ord(bad):04X}"
        raise UsageError(f"{flag}: not valid UTF-8 text ({shown} at character {e.start})") from None
    return value


_ID = re.compile(r"[+-]?[0-9]+")


def _parse_ids(text: str, what: str, vocab: int | None = None) -> list[int]:
    parts = [x.strip() for x in text.split(",")]
    if parts and parts[-1] == "":
        parts.pop()  # a trailing comma
    ids = []
    for x in parts:
        if not _ID.fullmatch(x):
            raise UsageError(f"{what}: expected comma-separated integers, got {printable(x)!r}"
                             if x else f"{what}: empty entry in {printable(text)!r}")
        hi = MAX_TOKEN_ID if vocab is None else vocab - 1
        i = int(x) if len(x) <= 20 else None
        if i is None or not 0 <= i <= hi:
            raise UsageError(f"{what}: token id {printable(x, 40)} is outside the vocabulary (0..{hi})")
        ids.append(i)
    if not ids:
        raise UsageError(f"{what}: no token ids given")
    return ids


def _tokenizer(path: str):
    from engine.text.tokenizer import load_tokenizer

    return load_tokenizer(path)


def cmd_tokenize(args) -> int:
    text = _text(args.text, "--text")
    ids = _tokenizer(_model_path(args)).encode(text)
    print(json.dumps(ids))
    return 0


def cmd_detokenize(args) -> int:
    tok = _tokenizer(_model_path(args))
    ids = _parse_ids(args.ids, "--ids", vocab=tok.vocab_size)
    print(tok.decode(ids))
    return 0


def cmd_chat_template(args) -> int:
    try:
        messages = json.loads(_text(args.messages, "--messages"))
    except (ValueError, RecursionError) as e:    # RecursionError: nested past the parser's depth
        raise UsageError(f"--messages: not valid JSON: {e}") from None
    tok = _tokenizer(_model_path(args))
    try:
        text = tok.render_chat(messages, add_generation_prompt=not args.no_generation_prompt)
    except ValueError as e:
        raise UsageError(f"--messages: {e}") from None
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


def cmd_synth(args) -> int:
    from engine.tools.synth import write_synthetic

    write_synthetic(args.out, args.shape, random_blocks=args.random_blocks, seed=args.seed)
    print(args.out)
    return 0


def cmd_fetch_model(args) -> int:
    from engine.tools.fetch import fetch_default_model

    print(fetch_default_model(force=args.force))
    return 0


def cmd_relabel(args) -> int:
    from engine.tools.relabel import relabel_architecture

    relabel_architecture(args.model_in, args.out, _text(args.arch, "--arch"))
    print(args.out)
    return 0


def _load(args, model_file=None):
    from engine.loader import load_model

    return load_model(model_file or _model_path(args), device=args.device, progress=True)


def cmd_generate(args) -> int:
    from engine.generate import generate

    if (args.prompt is None) == (args.prompt_ids is None):
        raise UsageError("give exactly one of --prompt or --prompt-ids")
    if args.n < 0:
        raise UsageError(f"-n must be >= 0, got {args.n}")
    prompt = None if args.prompt is None else _text(args.prompt, "--prompt")
    ids = None if args.prompt_ids is None else _parse_ids(args.prompt_ids, "--prompt-ids")
    path = _model_path(args)
    tok = _tokenizer(path) if prompt is not None or not args.json else None
    if prompt is not None:
        ids = tok.encode(prompt)
        if not ids:
            raise UsageError("--prompt: the text encodes to no tokens")
    from engine.formats.weights import open_model

    model_file = open_model(path)   # checked before the weights load (seconds for a 7B model)
    n_ctx = model_file.config.n_ctx_train
    if len(ids) + args.n > n_ctx:
        room = f"-n can be at most {n_ctx - len(ids)}" if len(ids) < n_ctx else "no room left"
        raise UsageError(f"-n {args.n}: the prompt ({len(ids)} tokens) plus -n exceeds the model's "
                         f"context of {n_ctx} tokens ({room})")
    model = _load(args, model_file)
    eog = tok.eog_ids if tok is not None else _eog_ids(path)
    gen = generate(model, ids, args.n, eog)
    if args.json:
        print(json.dumps({"prompt_ids": ids, "tokens": gen.tokens, "stop_reason": gen.stop_reason,
                          "text": tok.decode(gen.tokens) if tok else None, "timings": gen.timings}))
    else:
        print(tok.decode(gen.tokens))
        print(f"tokens: {json.dumps(gen.tokens)}", file=sys.stderr)
        t = gen.timings
        print(f"prompt: {t['prompt_n']} tokens in {t['prompt_ms']:.1f} ms ({t['prompt_per_second']:.1f} tok/s); "
              f"generated: {t['predicted_n']} tokens in {t['predicted_ms']:.1f} ms "
              f"({t['predicted_per_second']:.2f} tok/s); stop: {gen.stop_reason}", file=sys.stderr)
    return 0


def _eog_ids(path: str) -> set[int]:
    """End-of-generation ids from the file's vocabulary, or just its eos id without one."""
    try:
        return set(_tokenizer(path).eog_ids)
    except (GGUFError, ImportError):
        from engine.formats.gguf_file import read_metadata
        from engine.formats.metadata import Metadata

        eos = Metadata(read_metadata(path), path).integer("tokenizer.ggml.eos_token_id", default=None,
                                                          lo=0, hi=MAX_TOKEN_ID)
        return {eos} if eos is not None else set()


def cmd_greedy32(args) -> int:
    from engine.tools import greedy32

    path = _model_path(args)
    cases = greedy32.load_goldens(args.golden)
    model = _load(args)
    eog = _eog_ids(path)
    if args.record:
        greedy32.record(model, cases, eog, args.record, source=f"gguf-prefill ({model.device}) on {path}")
        print(f"recorded {len(cases)} prompts to {args.record}")
        return 0
    rows = greedy32.run(model, cases, eog, args.min_margin, teacher=args.teacher_forced)
    print(greedy32.format_rows(rows))
    if args.json:
        print(greedy32.rows_json(rows))
    return 0 if all(r.ok for r in rows) else 1


def cmd_serve(args) -> int:
    """The server's own entry point parses the serve flags (server.main.main)."""
    from server.main import main as serve_main  # lazy: the engine does not import the server

    return serve_main(list(args.serve_args)) or 0


def cmd_bench(args) -> int:
    from engine.tools.bench import main as bench_main

    return bench_main(args)


def cmd_slice(args) -> int:
    from engine.tools.slice import slice_model

    layers = [int(i) for i in _parse_ids(args.layers, "--layers")]
    slice_model(args.model, args.out, layers=layers, vocab=args.vocab, ffn=args.ffn)
    print(args.out)
    return 0


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in every --help; flags without a default (None) or with store_true say nothing."""

    def _get_help_string(self, action):
        h = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in h or action.nargs == 0:
            return h
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one stderr line (exit 2), like every other bad input."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {printable(message, MAX_ERROR_CHARS)} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, formatter_class=_Formatter,
                description="Prefill and greedy decoding for GGUF q4_K_M models, and the HTTP server. "
                            "Bad input prints one line on stderr and exits 2.")
    p.add_argument("--version", action="version", version=f"{PROG} {version()}")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB", parser_class=_Parser)

    def verb(name, fn, help_, model=True, device=False, **kw):
        s = sub.add_parser(name, help=help_, description=help_, formatter_class=_Formatter, **kw)
        if model:
            s.add_argument("--model", "-m", help="GGUF file (default: the cached default model)")
        if device:
            s.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                           help="backend; auto takes the GPU when CuPy sees one")
        s.set_defaults(fn=fn)
        return s

    s = verb("tokenize", cmd_tokenize, "text -> token ids (JSON list on the last line)")
    s.add_argument("--text", required=True, help="the text to encode")
    s = verb("detokenize", cmd_detokenize, "token ids -> text")
    s.add_argument("--ids", required=True, help="comma-separated ids")
    s = verb("chat-template", cmd_chat_template, "render the model's chat template")
    s.add_argument("--messages", required=True, help='JSON list of {"role", "content"}')
    s.add_argument("--no-generation-prompt", action="store_true",
                   help="leave out the assistant turn's opening")
    s = verb("synth", cmd_synth, "write a synthetic GGUF with real model shapes", model=False)
    s.add_argument("--shape", required=True, choices=SYNTH_SHAPES, help="model shape")
    s.add_argument("--random-blocks", action="store_true", help="random valid blocks (fast; for benchmarks)")
    s.add_argument("--seed", type=int, default=0, help="weights seed")
    s.add_argument("out", help="output GGUF path")
    s = verb("fetch-model", cmd_fetch_model, "download, verify and cache the default model", model=False)
    s.add_argument("--force", action="store_true", help="fetch again even when cached")
    s = verb("relabel", cmd_relabel, "copy a GGUF under another architecture name", model=False)
    s.add_argument("model_in", help="input GGUF path")
    s.add_argument("out", help="output GGUF path")
    s.add_argument("--arch", default="llama", help="the new general.architecture")
    s = verb("generate", cmd_generate, "greedy decoding", device=True)
    s.add_argument("--prompt", help="prompt text (tokenized with the model's vocabulary)")
    s.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    s.add_argument("-n", type=int, default=32,
                   help="tokens to generate; prompt + n must fit the model's context")
    s.add_argument("--json", action="store_true", help="one JSON object on stdout")
    s = verb("greedy32", cmd_greedy32, "greedy-32 regression against goldens", device=True)
    s.add_argument("--golden", required=True, help="goldens JSON file")
    s.add_argument("--min-margin", type=float, default=None,
                   help="compare only steps whose golden margin is at least this (default: all)")
    s.add_argument("--teacher-forced", action="store_true", help="one prefill of prompt + golden tokens")
    s.add_argument("--record", metavar="OUT.json", help="write goldens from this engine instead")
    s.add_argument("--json", action="store_true", help="also print the rows as JSON")
    s = verb("serve", cmd_serve, "HTTP completion server (flags: gguf-prefill serve --help)",
             model=False, add_help=False)
    s.add_argument("serve_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    s = verb("bench", cmd_bench, "llama-bench style prefill/decode throughput", device=True)
    s.add_argument("-p", default="512", help="prompt lengths, comma-separated")
    s.add_argument("-n", default="0", help="generated lengths (tg rows), comma-separated")
    s.add_argument("-d", default="0", help="context depth before tg rows")
    s.add_argument("-r", type=int, default=5, help="repetitions")
    s.add_argument("--json", action="store_true", help="JSON rows")
    s.add_argument("--breakdown", action="store_true", help="per-op time breakdown")
    s.add_argument("--batched", default=None, metavar="NPL",
                   help="llama-batched-bench rows instead: NPL sequences at once through the "
                        "scheduler, comma-separated (with --npp, --ntg)")
    s.add_argument("--npp", type=int, default=256, help="--batched: prompt tokens per sequence")
    s.add_argument("--ntg", type=int, default=128, help="--batched: generated tokens per sequence")
    s.add_argument("--max-batch-tokens", type=int, default=512, help="--batched: tokens per step")
    s.add_argument("--overlap", choices=("on", "off", "both"), default="on",
                   help="--batched: plan the next step while the device runs this one")
    s = verb("slice", cmd_slice, "cut a small real-weight GGUF from a big one")
    s.add_argument("--layers", required=True, help="layers kept, comma-separated, in order")
    s.add_argument("--vocab", type=int, required=True, help="rows of the vocabulary kept")
    s.add_argument("--ffn", type=int, default=None, help="FFN columns kept (multiple of 256; default all)")
    s.add_argument("out", help="output GGUF path")
    return p


def _error_line(verb: str, e: BaseException) -> str:
    return printable(f"{PROG} {verb}: error: {e}", MAX_ERROR_CHARS)


def _warning_lines(verb: str, caught) -> list[str]:
    """Each distinct warning as one line (Python's default format takes two, with source)."""
    out: list[str] = []
    for w in caught:
        line = printable(f"{PROG} {verb}: warning: {w.category.__name__}: {w.message}", MAX_ERROR_CHARS)
        if line not in out:
            out.append(line)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        # The server parses its own flags (and GGUF_PREFILL_* variables); `serve --help` is its
        # help. Its warnings and logs stream as they come (a long-running process).
        try:
            return cmd_serve(argparse.Namespace(verb="serve", serve_args=argv[1:]))
        except KeyboardInterrupt:
            return 130
    args = build_parser().parse_args(argv)
    # Warnings (a tokenizer fallback, numpy overflow on odd weights) are held until the verb
    # ends: one line each after a success; after an error only the error line is printed.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            rc = args.fn(args)
        except (GGUFError, UsageError) as e:
            print(_error_line(args.verb, e), file=sys.stderr)
            return 2
        except MemoryError as e:
            print(_error_line(args.verb, f"out of memory ({e or 'allocation failed'})"), file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
    for line in _warning_lines(args.verb, caught):
        print(line, file=sys.stderr)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
