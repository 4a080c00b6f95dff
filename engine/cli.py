"""`gguf-prefill`: one function per verb. Bad input prints one line on stderr and exits 2."""
from __future__ import annotations

import argparse
import json
import sys

from engine.errors import GGUFError, UsageError


def _model_path(args) -> str:
    from engine.tools.fetch import resolve_model

    return resolve_model(args.model)


def _parse_ids(text: str, what: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError(f"{what}: no token ids given")
    return ids


def _tokenizer(path: str):
    from engine.text.tokenizer import load_tokenizer

    return load_tokenizer(path)


def cmd_tokenize(args) -> int:
    ids = _tokenizer(_model_path(args)).encode(args.text)
    print(json.dumps(ids))
    return 0


def cmd_detokenize(args) -> int:
    print(_tokenizer(_model_path(args)).decode(_parse_ids(args.ids, "--ids")))
    return 0


def cmd_chat_template(args) -> int:
    try:
        messages = json.loads(args.messages)
    except ValueError as e:
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

    relabel_architecture(args.model_in, args.out, args.arch)
    print(args.out)
    return 0


def _load(args):
    from engine.loader import load_model

    return load_model(_model_path(args), device=args.device, progress=True)


def cmd_generate(args) -> int:
    from engine.generate import generate

    path = _model_path(args)
    if (args.prompt is None) == (args.prompt_ids is None):
        raise UsageError("give exactly one of --prompt or --prompt-ids")
    tok = _tokenizer(path) if args.prompt is not None or not args.json else None
    ids = tok.encode(args.prompt) if args.prompt is not None else _parse_ids(args.prompt_ids, "--prompt-ids")
    model = _load(args)
    if args.n < 0:
        raise UsageError(f"-n must be >= 0, got {args.n}")
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

        eos = read_metadata(path).get("tokenizer.ggml.eos_token_id")
        return {int(eos)} if eos is not None else set()


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
    from server.main import serve

    return serve(args) or 0


def cmd_bench(args) -> int:
    from engine.tools.bench import main as bench_main

    return bench_main(args)


def cmd_slice(args) -> int:
    from engine.tools.slice import slice_model

    slice_model(args.model, args.out, layers=_parse_ids(args.layers, "--layers"), vocab=args.vocab, ffn=args.ffn)
    print(args.out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gguf-prefill", description=__doc__)
    sub = p.add_subparsers(dest="verb", required=True)

    def verb(name, fn, help_, model=True, device=False):
        s = sub.add_parser(name, help=help_)
        if model:
            s.add_argument("--model", "-m", help="GGUF file (default: the cached default model)")
        if device:
            s.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
        s.set_defaults(fn=fn)
        return s

    s = verb("tokenize", cmd_tokenize, "text -> token ids (JSON list on the last line)")
    s.add_argument("--text", required=True)
    s = verb("detokenize", cmd_detokenize, "token ids -> text")
    s.add_argument("--ids", required=True, help="comma-separated ids")
    s = verb("chat-template", cmd_chat_template, "render the model's chat template")
    s.add_argument("--messages", required=True, help='JSON list of {"role", "content"}')
    s.add_argument("--no-generation-prompt", action="store_true")
    s = verb("synth", cmd_synth, "write a synthetic GGUF with real model shapes", model=False)
    s.add_argument("--shape", required=True, choices=("tiny", "tiny-qwen2", "llama2-7b", "llama3-8b", "qwen2-7b"))
    s.add_argument("--random-blocks", action="store_true", help="random valid blocks (fast; for benchmarks)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("out")
    s = verb("fetch-model", cmd_fetch_model, "download, verify and cache the default model", model=False)
    s.add_argument("--force", action="store_true")
    s = verb("relabel", cmd_relabel, "copy a GGUF under another architecture name", model=False)
    s.add_argument("model_in")
    s.add_argument("out")
    s.add_argument("--arch", default="llama")
    s = verb("generate", cmd_generate, "greedy decoding", device=True)
    s.add_argument("--prompt")
    s.add_argument("--prompt-ids")
    s.add_argument("-n", type=int, default=32)
    s.add_argument("--json", action="store_true")
    s = verb("greedy32", cmd_greedy32, "greedy-32 regression against goldens", device=True)
    s.add_argument("--golden", required=True)
    s.add_argument("--min-margin", type=float, default=None)
    s.add_argument("--teacher-forced", action="store_true")
    s.add_argument("--record", metavar="OUT.json")
    s.add_argument("--json", action="store_true")
    s = verb("serve", cmd_serve, "HTTP completion server", model=False)
    try:
        from server.settings import add_serve_arguments

        add_serve_arguments(s)
    except ImportError:
        pass
    s = verb("bench", cmd_bench, "llama-bench style prefill/decode throughput", device=True)
    s.add_argument("-p", default="512", help="prompt lengths, comma-separated")
    s.add_argument("-n", default="0", help="generated lengths (tg rows), comma-separated")
    s.add_argument("-d", default="0", help="context depth before tg rows")
    s.add_argument("-r", type=int, default=5, help="repetitions")
    s.add_argument("--json", action="store_true")
    s.add_argument("--breakdown", action="store_true")
    s = verb("slice", cmd_slice, "cut a small real-weight GGUF from a big one")
    s.add_argument("--layers", required=True)
    s.add_argument("--vocab", type=int, required=True)
    s.add_argument("--ffn", type=int, default=None)
    s.add_argument("out")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (GGUFError, UsageError) as e:
        print(f"gguf-prefill {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
