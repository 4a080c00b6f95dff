"""Seeded mutation fuzzer: corrupt the synthetic models and run the CLI on every result.
(The mutations are in engine.tools.fuzz_mutate.)

    python -m engine.tools.fuzz --count 20000 --seed 1 [--jobs 2] [--json]
    python -m engine.tools.fuzz --seed 1 --case 1234 --write bad.gguf   # reproduce one case

Each case takes one of the synthetic models (`tiny`, `tiny-qwen2`; engine.tools.synth), applies
one to three mutations drawn from a seeded generator (byte flips, truncation, inflated counts and
lengths, metadata values of the wrong type, NaN/inf, arrays for scalars and scalars for arrays,
missing/duplicate/odd keys, tensor-info changes, broken chat templates), writes the file and runs
`engine.cli.main` in-process on it: `generate --device cpu` with a short prompt, `tokenize`, and
(for a template mutation) `chat-template`. A run passes when it exits 0 or 2, and on 2 prints
exactly one stderr line; it fails as

    traceback   an exception escaped main() (or "Traceback" on stderr)
    multiline   exit 2 with more or fewer than one stderr line, or exit 0 with stderr output
                other than the CLI's one-line warnings (counted as `warned`)
    bad_exit    any other exit status
    hang        no result within --timeout seconds of the worker's CPU time, or 10x that of
                wall time (a stall); the worker is killed and restarted. CPU time keeps a
                busy shared machine from turning slow cases into false hangs
    over_cap    an allocation failed under the --as-limit address-space cap (default 8 GiB)
    crash       the worker process died (signal)

Cases run in worker processes (RLIMIT_AS set before exec), each case numbered: (seed, case)
fixes the file and the commands, so any failure is reproduced with --case.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import selectors
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter

from engine.tools.fuzz_mutate import Case, make_bases, make_case

DEFAULT_AS_LIMIT = 8 << 30
DEFAULT_TIMEOUT = 20.0
RESTART_EVERY = 1000          # cases per worker before a fresh one (bounds slow leaks)

# ----------------------------------------------------------------------------- one run

def run_cli(argv: list[str], err_fd_file=None) -> dict:
    """engine.cli.main(argv) in-process: exit status, stderr, and the traceback if one escaped."""
    from engine.cli import main

    out, err = io.StringIO(), io.StringIO()
    tb = None
    t0 = time.perf_counter()
    pos = err_fd_file.tell() if err_fd_file is not None else 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except MemoryError:
        rc, tb = 1, "MemoryError\n" + traceback.format_exc(limit=-8)
    except BaseException as e:  # noqa: BLE001 - the point is to catch everything
        if isinstance(e, KeyboardInterrupt):
            raise
        rc, tb = 1, traceback.format_exc(limit=-8)
    stderr = err.getvalue()
    if err_fd_file is not None:   # writes straight to fd 2 (C or Rust code)
        err_fd_file.seek(pos)
        extra = err_fd_file.read()
        if extra:
            stderr += extra.decode("utf-8", "replace")
    return {"rc": rc, "stderr": stderr, "traceback": tb, "s": round(time.perf_counter() - t0, 3)}


def classify(r: dict) -> str | None:
    """The failure kind of one run, or None when it passed."""
    err = r["stderr"]
    if r["traceback"] is not None and r["traceback"].startswith("MemoryError"):
        return "over_cap"
    if r["rc"] == 2 and "error: out of memory" in err:
        return "over_cap"
    if r["traceback"] is not None or "Traceback (most recent call last)" in err:
        return "traceback"
    if r["rc"] not in (0, 2):
        return "bad_exit"
    lines = err.splitlines()
    if r["rc"] == 2 and (len(lines) != 1 or not err.endswith("\n") or err.count("\n") != 1):
        return "multiline"
    if r["rc"] == 0 and any(" warning: " not in ln or not ln.startswith("gguf-prefill ") for ln in lines):
        return "multiline"   # on success only the CLI's one-line warnings may reach stderr
    return None


def run_case(case: Case, directory: str, err_fd_file=None) -> dict:
    path = os.path.join(directory, f"case-{case.index}.gguf")
    with open(path, "wb") as f:
        f.write(case.data)
    runs = []
    try:
        for cmd in case.commands:
            argv = [cmd[0], "--model", path, *cmd[1:]]
            r = run_cli(argv, err_fd_file)
            r["argv"] = cmd
            r["kind"] = classify(r)
            runs.append(r)
    finally:
        os.remove(path)
        _forget(path)
    return {"case": case.index, "base": case.base, "mutations": case.mutations, "runs": runs}


def _forget(path: str) -> None:
    """Drop per-file caches (the tokenizer caches by path) so a long run measures each file."""
    mod = sys.modules.get("engine.text.tokenizer")
    cache = getattr(mod, "_CACHE", None)
    if isinstance(cache, dict):
        cache.clear()


# ----------------------------------------------------------------------------- workers

def worker(seed: int, directory: str) -> int:
    """Read case numbers on stdin, answer one JSON line per case on the protocol fd."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    err_file = tempfile.TemporaryFile(dir=directory)
    os.dup2(err_file.fileno(), 2)
    sys.stderr = io.TextIOWrapper(os.fdopen(os.dup(2), "wb", buffering=0), write_through=True)
    bases = make_bases(directory)
    # Harness self-test (tests/test_fuzz.py): GGUF_PREFILL_FUZZ_SELFTEST="hang:3,crash:5,alloc:7"
    # makes those cases sleep, die or allocate past the cap, to show each is caught.
    selftest = dict(x.split(":")[::-1] for x in os.environ.get("GGUF_PREFILL_FUZZ_SELFTEST", "").split(",") if x)
    for line in sys.stdin:
        index = int(line)
        what = selftest.get(str(index))
        if what == "hang":
            time.sleep(3600)
        elif what == "crash":
            os.kill(os.getpid(), 9)
        elif what == "alloc":
            try:
                bytearray(DEFAULT_AS_LIMIT)
            except MemoryError:
                proto.write(json.dumps({"case": index, "base": "selftest", "mutations": ["alloc"], "runs": [
                    {"rc": 1, "stderr": "", "traceback": "MemoryError\n", "s": 0, "argv": ["selftest"],
                     "kind": "over_cap"}]}) + "\n")
                continue
        case = make_case(bases, seed, index)
        res = run_case(case, directory, err_file)
        proto.write(json.dumps(res) + "\n")
    return 0


def _limit_as(limit: int):
    def pre():
        os.setpgrp()
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return pre


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc; wall-clock fallback elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return time.monotonic()


class Pool:
    """Worker processes fed one case at a time, with a per-case deadline."""

    def __init__(self, jobs: int, seed: int, directory: str, as_limit: int, timeout: float):
        self.args = (seed, directory, as_limit)
        self.timeout = timeout
        self.sel = selectors.DefaultSelector()
        self.workers = [self._spawn() for _ in range(jobs)]

    def _spawn(self):
        seed, directory, as_limit = self.args
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        p = subprocess.Popen([sys.executable, "-m", "engine.tools.fuzz", "--worker", "--seed", str(seed),
                              "--dir", directory], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, env=env, text=True, bufsize=1,
                             preexec_fn=_limit_as(as_limit))
        w = {"p": p, "case": None, "t0": 0.0, "cpu0": 0.0, "done": 0}
        self.sel.register(p.stdout, selectors.EVENT_READ, w)
        return w

    def _replace(self, w):
        self.sel.unregister(w["p"].stdout)
        try:
            os.killpg(w["p"].pid, 9)
        except OSError:
            pass
        w["p"].wait()
        i = self.workers.index(w)
        self.workers[i] = self._spawn()
        return self.workers[i]

    def run(self, cases, on_result):
        todo = list(cases)[::-1]

        def feed(w):
            if todo:
                w["case"], w["t0"], w["cpu0"] = todo.pop(), time.monotonic(), _cpu_s(w["p"].pid)
                w["p"].stdin.write(f"{w['case']}\n")
                w["p"].stdin.flush()

        for w in self.workers:
            feed(w)
        while any(w["case"] is not None for w in self.workers):
            for key, _ in self.sel.select(timeout=0.5):
                w = key.data
                line = w["p"].stdout.readline()
                if not line:      # the worker died
                    case = w["case"]
                    rc = w["p"].wait()
                    on_result({"case": case, "crash": rc})
                    w = self._replace(w)
                    feed(w)
                    continue
                on_result(json.loads(line))
                w["case"] = None
                w["done"] += 1
                if w["done"] >= RESTART_EVERY:
                    w["p"].stdin.close()
                    w = self._replace(w)
                feed(w)
            now = time.monotonic()
            for w in list(self.workers):
                if w["case"] is None:
                    continue
                cpu = _cpu_s(w["p"].pid) - w["cpu0"]
                if cpu > self.timeout or now - w["t0"] > 10 * self.timeout:
                    on_result({"case": w["case"], "hang": round(now - w["t0"], 1), "cpu": round(cpu, 1)})
                    w = self._replace(w)
                    feed(w)
        for w in self.workers:
            self.sel.unregister(w["p"].stdout)
            w["p"].stdin.close()
            w["p"].wait()


KINDS = ("traceback", "multiline", "bad_exit", "hang", "over_cap", "crash")


def fuzz(count: int, seed: int, jobs: int = 1, as_limit: int = DEFAULT_AS_LIMIT,
         timeout: float = DEFAULT_TIMEOUT, start: int = 0, log=None, directory: str | None = None) -> dict:
    """Run cases start .. start+count-1; returns the summary (counts and the failures)."""
    own = directory is None
    directory = directory or tempfile.mkdtemp(prefix="gguf-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    make_bases(directory)  # once, before the workers (they read the same files)
    summary = {"seed": seed, "start": start, "count": count, "cases": 0, "runs": 0,
               "exit": Counter(), **{k: 0 for k in KINDS}, "warned": 0, "failures": [], "t": 0.0}
    seen: Counter = Counter()
    t0 = time.time()

    def on_result(res):
        summary["cases"] += 1
        kinds = []
        if "crash" in res:
            kinds.append(("crash", f"worker exit {res['crash']}"))
        elif "hang" in res:
            kinds.append(("hang", f"{res['hang']} s wall, {res.get('cpu')} s CPU"))
        else:
            for r in res["runs"]:
                summary["runs"] += 1
                summary["warned"] += r["rc"] == 0 and bool(r["stderr"].strip())
                summary["exit"][str(r["rc"])] += 1
                if r["kind"]:
                    sig = (r["traceback"] or r["stderr"]).strip().splitlines()[-1:] or [""]
                    kinds.append((r["kind"], f"{r['argv'][0]}: {sig[0][:300]}"))
        for kind, sig in kinds:
            summary[kind] += 1
            key = (kind, sig[:120])
            seen[key] += 1
            if seen[key] <= 2 and len(summary["failures"]) < 200:
                summary["failures"].append({"kind": kind, "case": res["case"], "signature": sig,
                                            "mutations": res.get("mutations"),
                                            "detail": _detail(res, kind)})
        if log is not None and summary["cases"] % 500 == 0:
            print(f"[fuzz] {summary['cases']}/{count} cases, "
                  + ", ".join(f"{k} {summary[k]}" for k in KINDS) + f", {time.time() - t0:.0f} s",
                  file=log, flush=True)

    try:
        Pool(jobs, seed, directory, as_limit, timeout).run(range(start, start + count), on_result)
    finally:
        if own:
            for name in os.listdir(directory):
                os.remove(os.path.join(directory, name))
            os.rmdir(directory)
    summary["exit"] = dict(summary["exit"])
    summary["t"] = round(time.time() - t0, 1)
    summary["distinct"] = {f"{k}: {s}": n for (k, s), n in seen.most_common(50)}
    return summary


def _detail(res: dict, kind: str) -> str:
    for r in res.get("runs", ()):
        if r["kind"] == kind:
            return ((r["traceback"] or "") + r["stderr"])[-2000:]
    return ""


def write_case(seed: int, index: int, out: str) -> Case:
    with tempfile.TemporaryDirectory() as d:
        case = make_case(make_bases(d), seed, index)
    with open(out, "wb") as f:
        f.write(case.data)
    return case


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.tools.fuzz", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--count", type=int, default=200, help="cases to run")
    ap.add_argument("--seed", type=int, default=0, help="seed: (seed, case) fixes each file")
    ap.add_argument("--start", type=int, default=0, help="first case number")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--as-limit", type=int, default=DEFAULT_AS_LIMIT, help="address-space cap per worker (bytes)")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="CPU seconds per case before it is a hang (10x as wall)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--case", type=int, default=None, help="with --write: reproduce this case")
    ap.add_argument("--write", metavar="OUT.gguf", help="write case --case's file and print its commands")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.seed, args.dir)
    if args.write:
        case = write_case(args.seed, args.case or 0, args.write)
        print(f"case {case.index} (seed {args.seed}) from {case.base}: {'; '.join(case.mutations)}")
        for cmd in case.commands:
            print("gguf-prefill " + " ".join([cmd[0], "--model", args.write, *map(_quote, cmd[1:])]))
        return 0
    s = fuzz(args.count, args.seed, args.jobs, args.as_limit, args.timeout, args.start, log=sys.stderr)
    if args.json:
        print(json.dumps(s, indent=1))
    else:
        print(f"seed {s['seed']}, cases {s['start']}..{s['start'] + s['cases'] - 1}: {s['cases']} files, "
              f"{s['runs']} runs, exit codes {s['exit']}, " + ", ".join(f"{k} {s[k]}" for k in KINDS)
              + f"; exit 0 with warning lines: {s['warned']} ({s['t']} s)")
        for sig, n in s["distinct"].items():
            print(f"  {n:5d}  {sig}")
    return 0 if all(s[k] == 0 for k in KINDS) else 1


def _quote(a: str) -> str:
    import shlex

    return shlex.quote(a)


if __name__ == "__main__":
    raise SystemExit(main())
