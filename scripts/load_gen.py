"""Load generator: many concurrent streaming users against a local gguf-prefill server.

    python3 scripts/load_gen.py --port 8080 --concurrency 1,8,32 --prompt-tokens 256 \
        --max-tokens 128 [--requests N] [--shared-prefix N] [--warmup 1] [--json OUT.json]

Every request is POST /v1/completions with
    {"prompt": [ids], "max_tokens": M, "stream": true, "stream_options": {"include_usage": true},
     "ignore_eos": true, "temperature": 0}
where the prompt is --prompt-tokens random ids in [--id-lo, --id-hi) from one seeded numpy
generator (--seed), a fresh prompt per request (warmup included, so no measured prompt repeats
an earlier one). --shared-prefix N: every prompt (warmup included) starts with the same N ids
and the rest, prompt-tokens - N, is fresh (a prefix-cache measurement).

Each concurrency level runs in turn: `concurrency` users, each one connection per request
(Connection: close), sending its next request as soon as its previous one finished, until the
level's --requests (default 2 x concurrency) have been sent. Bounds: --timeout seconds per
request (an error when it passes), --max-seconds per level (requests in flight at that moment
are cut, counted under `cut`, and no more are sent).

What is measured, per request, from the SSE stream (`data: {...}` events, `data: [DONE]`):
- TTFT: from just before the connection is opened to the first chunk that carries generated
  tokens (a chunk with a choice whose finish_reason is still null, or whose text is non-empty).
- inter-token latency: the gaps between consecutive token-carrying chunks (the server may merge
  tokens whose bytes do not end a UTF-8 character into one chunk, so this is per chunk).
- tokens: usage.completion_tokens / usage.prompt_tokens of the usage chunk (or of the finish
  chunk, llama-server style); without usage, the number of token chunks and the prompt length.
- errors: an HTTP status other than 200, an error event in the stream, a stream that ends
  without [DONE], a connection failure, or --timeout passing.

Per level, from the first request sent to the last response completed (wall): aggregate
generated tok/s (all completion tokens / wall), aggregate prompt tok/s, TTFT p50/p99 (s),
inter-token latency p50/p99 (ms), and the median per-request decode rate
((completion_tokens - 1) / (last token chunk - first token chunk)). One line per level, then a
table. --json OUT writes {"config": ..., "records": [...]} (rewritten after every level).

Only 127.0.0.1 is ever contacted (--host takes nothing else). Stdlib + numpy only (asyncio
streams; no HTTP library). Exit status: 0 when every level ran (errors are in the records),
1 when the warmup got no successful answer (server not up?), 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence

import numpy as np

ALLOWED_HOST = "127.0.0.1"
MAX_CONCURRENCY = 256
MAX_REQUESTS = 4096
MAX_ERROR_BODY = 64 * 1024       # bytes of a non-200 body kept for the message
MAX_LINE = 1 << 20               # longest status/header/chunk-size line accepted
ERROR_SAMPLES = 5                # distinct error messages kept per level


# ---- statistics ------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0 <= q <= 100) with linear interpolation between closest ranks
    (numpy's default 'linear' method); None for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile: q={q} is outside 0..100")
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    frac = pos - lo
    return xs[lo] + (xs[hi] - xs[lo]) * frac


# ---- arguments -------------------------------------------------------------------------------

def check_host(host: str) -> str:
    if host != ALLOWED_HOST:
        raise ValueError(f"refusing host {host!r}: load_gen only targets {ALLOWED_HOST} "
                         "(a server on this machine)")
    return host


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--concurrency {text!r}: give a comma-separated list of integers") from None
    if not levels:
        raise ValueError("--concurrency: give at least one level")
    bad = [c for c in levels if not 1 <= c <= MAX_CONCURRENCY]
    if bad:
        raise ValueError(f"--concurrency: {bad[0]} is outside 1..{MAX_CONCURRENCY}")
    return levels


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="load_gen.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default=ALLOWED_HOST, help=f"only {ALLOWED_HOST} is accepted")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--concurrency", default="1,8,32",
                    help=f"comma-separated levels, each run in turn (each 1..{MAX_CONCURRENCY})")
    ap.add_argument("--requests", type=int, default=None,
                    help=f"requests per level (default 2 x the level; at most {MAX_REQUESTS})")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--max-seconds", type=float, default=1800.0,
                    help="bound on one level's wall time; requests still running are cut")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--id-lo", type=int, default=100, help="prompt ids are drawn from [lo, hi)")
    ap.add_argument("--id-hi", type=int, default=20000)
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="every prompt begins with the same N ids")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1,
                    help="requests sent one at a time before measuring (not recorded)")
    ap.add_argument("--model", default=None, help="the request's `model` field (default: none)")
    ap.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    ap.add_argument("--json", dest="json_out", default=None, metavar="OUT",
                    help="write every level's record to OUT")
    return ap


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        check_host(a.host)
        a.levels = parse_levels(a.concurrency)
        if not 1 <= a.port <= 65535:
            raise ValueError(f"--port {a.port} is outside 1..65535")
        if a.requests is not None and not 1 <= a.requests <= MAX_REQUESTS:
            raise ValueError(f"--requests {a.requests} is outside 1..{MAX_REQUESTS}")
        if not (a.timeout > 0 and math.isfinite(a.timeout)):
            raise ValueError("--timeout must be a positive number of seconds")
        if not (a.max_seconds > 0 and math.isfinite(a.max_seconds)):
            raise ValueError("--max-seconds must be a positive number of seconds")
        if a.prompt_tokens < 1:
            raise ValueError("--prompt-tokens must be >= 1")
        if a.max_tokens < 1:
            raise ValueError("--max-tokens must be >= 1")
        if not 0 <= a.id_lo < a.id_hi <= 2**31 - 1:
            raise ValueError(f"--id-lo/--id-hi: need 0 <= lo < hi, got [{a.id_lo}, {a.id_hi})")
        if not 0 <= a.shared_prefix <= a.prompt_tokens:
            raise ValueError(f"--shared-prefix {a.shared_prefix} must be in 0..--prompt-tokens "
                             f"({a.prompt_tokens})")
        if not 0 <= a.warmup <= MAX_REQUESTS:
            raise ValueError(f"--warmup {a.warmup} is outside 0..{MAX_REQUESTS}")
    except ValueError as e:
        ap.error(str(e))
    return a


def level_requests(args: argparse.Namespace, concurrency: int) -> int:
    return args.requests if args.requests is not None else min(2 * concurrency, MAX_REQUESTS)


# ---- prompts ---------------------------------------------------------------------------------

class PromptSource:
    """Fresh random prompts from one seeded generator; the first `shared_prefix` ids are the
    same in every prompt."""

    def __init__(self, n_tokens: int, lo: int, hi: int, seed: int, shared_prefix: int = 0):
        self.rng = np.random.default_rng(seed)
        self.n_tokens, self.lo, self.hi = n_tokens, lo, hi
        self.prefix = self._draw(shared_prefix)

    def _draw(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.integers(self.lo, self.hi, size=n, dtype=np.int64)]

    def next(self) -> list[int]:
        return self.prefix + self._draw(self.n_tokens - len(self.prefix))


def request_body(prompt: list[int], max_tokens: int, model: Optional[str] = None) -> bytes:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": True,
                            "temperature": 0}
    if model:
        body["model"] = model
    return json.dumps(body, separators=(",", ":")).encode()


# ---- one request -----------------------------------------------------------------------------

class HTTPError(Exception):
    pass


@dataclass
class Result:
    prompt_len: int
    t_start: float = 0.0
    t_end: float = 0.0
    status: Optional[int] = None
    ok: bool = False
    cut: bool = False             # stopped by --max-seconds (not an error)
    error: Optional[str] = None
    chunk_times: list[float] = field(default_factory=list)  # token-carrying chunks
    completion_tokens: Optional[int] = None  # from usage
    prompt_tokens: Optional[int] = None
    done: bool = False            # saw data: [DONE]

    @property
    def t_first(self) -> Optional[float]:
        return self.chunk_times[0] if self.chunk_times else None

    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times)

    def prompt_count(self) -> int:
        if self.prompt_tokens is not None:
            return self.prompt_tokens
        return self.prompt_len if self.chunk_times else 0  # no token: the prefill may not have run


async def _read_line(reader: asyncio.StreamReader) -> bytes:
    line = await reader.readline()
    if len(line) > MAX_LINE:
        raise HTTPError("response line too long")
    return line


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await _read_line(reader)
    if not status_line:
        raise HTTPError("connection closed before the response status line")
    parts = status_line.decode("latin-1").split(None, 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise HTTPError(f"bad status line {status_line[:80]!r}")
    headers: dict[str, str] = {}
    while True:
        line = await _read_line(reader)
        if not line:
            raise HTTPError("connection closed inside the response headers")
        if line in (b"\r\n", b"\n"):
            break
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(parts[1]), headers


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The response body as it arrives: chunked, Content-Length, or up to EOF."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await _read_line(reader)
            if not size_line:
                raise HTTPError("connection closed inside a chunked body")
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise HTTPError(f"bad chunk size line {size_line[:40]!r}") from None
            if size == 0:
                while (await _read_line(reader)) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)  # CRLF after the chunk
            yield data
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left > 0:
            data = await reader.read(min(left, 65536))
            if not data:
                raise HTTPError("connection closed before Content-Length bytes")
            left -= len(data)
            yield data
    else:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            yield data


def _handle_event(res: Result, data: str, now: float) -> None:
    """One SSE event's data."""
    if data == "[DONE]":
        res.done = True
        return
    try:
        ev = json.loads(data)
    except json.JSONDecodeError:
        raise HTTPError(f"stream event is not JSON: {data[:80]!r}") from None
    if not isinstance(ev, dict):
        raise HTTPError(f"stream event is not an object: {data[:80]!r}")
    if "error" in ev:
        err = ev["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise HTTPError(f"error event: {str(msg)[:200]}")
    usage = ev.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("completion_tokens"), int):
            res.completion_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            res.prompt_tokens = usage["prompt_tokens"]
    choices = ev.get("choices") or []
    if choices and isinstance(choices[0], dict):
        c = choices[0]
        text = c.get("text")
        if text is None:  # a chat-shaped chunk
            text = (c.get("delta") or {}).get("content")
        if text or c.get("finish_reason") is None:
            res.chunk_times.append(now)


async def run_request(res: Result, port: int, body: bytes, api_key: Optional[str] = None) -> None:
    """Send one request and read its stream into `res` (which keeps what arrived if this is
    cancelled). Raises HTTPError / OSError / asyncio errors on failure."""
    res.t_start = time.perf_counter()
    reader, writer = await asyncio.open_connection(ALLOWED_HOST, port, limit=MAX_LINE)
    try:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {ALLOWED_HOST}:{port}\r\n"
                "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n")
        if api_key:
            head += f"Authorization: Bearer {api_key}\r\n"
        writer.write(head.encode("latin-1") + b"\r\n" + body)
        await writer.drain()
        res.status, headers = await _read_head(reader)
        if res.status != 200:
            got = b""
            pieces = _body(reader, headers)
            try:
                async for piece in pieces:
                    got += piece
                    if len(got) >= MAX_ERROR_BODY:
                        break
            except (HTTPError, OSError, asyncio.IncompleteReadError):
                pass  # the status is the error; the body only words it
            finally:
                await pieces.aclose()
            msg = got.decode("utf-8", "replace")
            try:
                err = json.loads(msg).get("error")
                msg = err.get("message", msg) if isinstance(err, dict) else msg
            except (ValueError, AttributeError):
                pass
            raise HTTPError(f"HTTP {res.status}: {msg[:200]}")
        pieces = _body(reader, headers)
        try:
            await _read_stream(res, pieces)
        finally:
            await pieces.aclose()
        res.ok = True
    finally:
        res.t_end = time.perf_counter()
        writer.close()


async def _read_stream(res: Result, pieces: AsyncIterator[bytes]) -> None:
    """SSE events (`data:` lines, a blank line ends one) into `res`, up to data: [DONE]."""
    buf = b""
    data_lines: list[str] = []
    async for piece in pieces:
        now = time.perf_counter()
        buf += piece
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", "replace")
            if not line:  # end of an event
                if data_lines:
                    _handle_event(res, "\n".join(data_lines), now)
                    data_lines = []
            elif line.startswith("data:"):
                d = line[5:]
                data_lines.append(d[1:] if d.startswith(" ") else d)
            # other fields (event:, id:, retry:) and comments are ignored
        if res.done:
            break
    if data_lines and not res.done:
        _handle_event(res, "\n".join(data_lines), time.perf_counter())
    if not res.done:
        raise HTTPError("stream ended without data: [DONE]")


async def bounded_request(port: int, prompt: list[int], args: argparse.Namespace,
                          deadline: Optional[float] = None) -> Result:
    """One request under --timeout and the level's deadline; never raises."""
    res = Result(prompt_len=len(prompt))
    body = request_body(prompt, args.max_tokens, args.model)
    limit = args.timeout
    cut_by_deadline = False
    if deadline is not None:
        left = deadline - time.perf_counter()
        if left < limit:
            limit, cut_by_deadline = max(left, 0.0), True
    try:
        await asyncio.wait_for(run_request(res, port, body, args.api_key), limit)
    except asyncio.TimeoutError:
        if cut_by_deadline:
            res.cut = True
        else:
            res.error = f"timeout after {args.timeout:g} s"
    except (HTTPError, OSError, asyncio.IncompleteReadError, ValueError, UnicodeError) as e:
        res.error = str(e) or type(e).__name__
        if isinstance(e, OSError) and not isinstance(e, HTTPError):
            res.error = f"{type(e).__name__}: {e}"
    if not res.t_end:
        res.t_end = time.perf_counter()
    if res.error is not None or res.cut:
        res.ok = False
    return res


# ---- one level -------------------------------------------------------------------------------

async def run_level(args: argparse.Namespace, concurrency: int, n_requests: int,
                    prompts: PromptSource) -> list[Result]:
    deadline = time.perf_counter() + args.max_seconds
    todo = [prompts.next() for _ in range(n_requests)]  # drawn up front: same prompts every run
    todo.reverse()
    results: list[Result] = []

    async def user() -> None:
        while todo and time.perf_counter() < deadline:
            results.append(await bounded_request(args.port, todo.pop(), args, deadline))

    await asyncio.gather(*(user() for _ in range(min(concurrency, n_requests))))
    return results


def summarize(concurrency: int, planned: int, results: list[Result]) -> dict[str, Any]:
    sent = [r for r in results if r.t_start]
    ok = [r for r in results if r.ok]
    errors = [r for r in results if r.error is not None]
    cut = [r for r in results if r.cut]
    wall = (max(r.t_end for r in sent) - min(r.t_start for r in sent)) if sent else 0.0
    completion = sum(r.tokens() for r in results)
    prompt = sum(r.prompt_count() for r in results)
    ttft = [r.t_first - r.t_start for r in sorted(results, key=lambda r: r.t_start or 0.0)
            if r.t_first is not None]
    itl = [(b - a) * 1e3 for r in results for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    decode = [(r.tokens() - 1) / (r.chunk_times[-1] - r.chunk_times[0]) for r in ok
              if r.tokens() >= 2 and len(r.chunk_times) >= 2 and r.chunk_times[-1] > r.chunk_times[0]]
    samples: list[str] = []
    for r in errors:
        if r.error not in samples and len(samples) < ERROR_SAMPLES:
            samples.append(r.error)
    usage_n = sum(1 for r in results if r.completion_tokens is not None)
    rate = (lambda n: n / wall if wall > 0 else None)
    return {
        "concurrency": concurrency,
        "requests": len(results),             # sent
        "planned": planned,
        "ok": len(ok),
        "errors": len(errors),
        "cut": len(cut),
        "wall_s": wall,
        "completion_tokens": completion,
        "prompt_tokens": prompt,
        "gen_tok_s": rate(completion),
        "prompt_tok_s": rate(prompt),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "ttfts_s": [round(t, 4) for t in ttft],   # per request, in the order they were sent
        "itl_p50_ms": percentile(itl, 50),
        "itl_p99_ms": percentile(itl, 99),
        "req_decode_tok_s_p50": percentile(decode, 50),
        "token_counts": ("usage" if usage_n == len(results) else
                         "chunks" if usage_n == 0 else "mixed"),
        "error_samples": samples,
    }


def _f(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def level_line(r: dict[str, Any]) -> str:
    line = (f"c={r['concurrency']} req={r['requests']} err={r['errors']} "
            f"wall={r['wall_s']:.2f}s gen={_f(r['gen_tok_s'], '.1f')} tok/s "
            f"prompt={_f(r['prompt_tok_s'], '.1f')} tok/s "
            f"TTFT p50/p99={_f(r['ttft_p50_s'], '.3f')}/{_f(r['ttft_p99_s'], '.3f')} s "
            f"ITL p50/p99={_f(r['itl_p50_ms'], '.1f')}/{_f(r['itl_p99_ms'], '.1f')} ms "
            f"decode/req p50={_f(r['req_decode_tok_s_p50'], '.1f')} tok/s")
    if r["cut"]:
        line += f" cut={r['cut']} (--max-seconds)"
    if r["requests"] < r["planned"]:
        line += f" unsent={r['planned'] - r['requests']}"
    if r["error_samples"]:
        line += f" first error: {r['error_samples'][0]}"
    return line


def table(records: list[dict[str, Any]]) -> str:
    cols = [("conc", "concurrency", "d"), ("req", "requests", "d"), ("err", "errors", "d"),
            ("wall s", "wall_s", ".2f"), ("gen tok/s", "gen_tok_s", ".1f"),
            ("prompt tok/s", "prompt_tok_s", ".1f"), ("TTFT p50 s", "ttft_p50_s", ".3f"),
            ("TTFT p99 s", "ttft_p99_s", ".3f"), ("ITL p50 ms", "itl_p50_ms", ".1f"),
            ("ITL p99 ms", "itl_p99_ms", ".1f"), ("req tok/s p50", "req_decode_tok_s_p50", ".1f")]
    rows = [[h for h, _, _ in cols]] + [[_f(r[k], s) for _, k, s in cols] for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    out = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


# ---- the run ---------------------------------------------------------------------------------

def config_of(args: argparse.Namespace) -> dict[str, Any]:
    return {"host": args.host, "port": args.port, "concurrency": args.levels,
            "requests": args.requests, "timeout_s": args.timeout, "max_seconds": args.max_seconds,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "id_lo": args.id_lo, "id_hi": args.id_hi, "shared_prefix": args.shared_prefix,
            "seed": args.seed, "warmup": args.warmup, "model": args.model}


def write_json(path: str, args: argparse.Namespace, records: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump({"config": config_of(args), "records": records}, f, indent=2)
        f.write("\n")


async def run(args: argparse.Namespace) -> tuple[int, list[dict[str, Any]]]:
    prompts = PromptSource(args.prompt_tokens, args.id_lo, args.id_hi, args.seed, args.shared_prefix)
    print(f"load_gen: {ALLOWED_HOST}:{args.port} levels {args.levels} prompt {args.prompt_tokens} "
          f"ids in [{args.id_lo}, {args.id_hi}) shared prefix {args.shared_prefix} max_tokens "
          f"{args.max_tokens} seed {args.seed}", flush=True)
    if args.warmup:
        t0 = time.perf_counter()
        warm = [await bounded_request(args.port, prompts.next(), args) for _ in range(args.warmup)]
        bad = [r for r in warm if not r.ok]
        print(f"warmup: {args.warmup} requests, {len(bad)} failed, {time.perf_counter() - t0:.2f} s"
              + (f" ({bad[0].error})" if bad else ""), flush=True)
        if len(bad) == len(warm):
            print(f"load_gen: no warmup request succeeded against {ALLOWED_HOST}:{args.port}: "
                  f"{bad[0].error}", file=sys.stderr)
            return 1, []
    records: list[dict[str, Any]] = []
    for c in args.levels:
        n = level_requests(args, c)
        rec = summarize(c, n, await run_level(args, c, n, prompts))
        records.append(rec)
        print(level_line(rec), flush=True)
        if args.json_out:
            write_json(args.json_out, args, records)
    print(table(records), flush=True)
    return 0, records


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    rc, _ = asyncio.run(run(args))
    return rc


if __name__ == "__main__":
    sys.exit(main())
