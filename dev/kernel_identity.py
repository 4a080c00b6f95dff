"""Machine-code identity of kernel instances across two trees, on the CPU (no GPU).

Compiles kernel instances with NVRTC exactly as engine.gpu.kernels.compile_for_check does (same
source assembly and options, -arch=sm_90, sm_90a for the wgmma files) and records, per instance,
the sha256 of its SASS (the cubin's .text.<lowered name> section) and of its parameter bank size. Two dumps of the same
instance that agree ran the very same machine code: a refactor of the kernel sources (a header
moved, an unused arm removed, a kernel renamed) that keeps every production hash is bit-identical
and cannot move performance.

    python -m dev.kernel_identity dump OUT.json [--root TREE] [--only "FILE:NAME;..."]
    python -m dev.kernel_identity compare OLD.json NEW.json [--map OLDNAME=NEWNAME,...]

GGUF_PREFILL_KERNEL_DEFINES, when set, is applied as in the product (a define set's build).
--root: another checkout (e.g. `git archive <commit> engine kernels_cu | tar -x -C /tmp/old`),
imported instead of this one. --only: restrict to these instances (default: every listed one).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys


def elf_sections(blob: bytes) -> dict[str, bytes]:
    """{section name: bytes} of a 64-bit little-endian ELF (a cubin)."""
    assert blob[:4] == b"\x7fELF" and blob[4] == 2, "not an ELF64 cubin"
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    stro = hdrs[shstrndx][4]
    out = {}
    for name_off, _type, _flags, _addr, off, size, *_ in hdrs:
        end = blob.index(b"\0", stro + name_off)
        out[blob[stro + name_off:end].decode()] = blob[off:off + size]
    return out


def dump(only: set[tuple[str, str]] | None) -> dict[str, dict]:
    from engine.gpu import kernels

    nvrtc = kernels._nvrtc()
    res: dict[str, dict] = {}
    for fname in kernels.kernel_files():
        names = [n for n in kernels.INSTANCES.get(fname, ()) if only is None or (fname, n) in only]
        if not names:
            continue
        prog = nvrtc.createProgram(kernels.source(fname), fname, [], [])
        try:
            for n in names:
                nvrtc.addNameExpression(prog, n)
            arch = "sm_90a" if fname in kernels.SM90A_FILES else "sm_90"     # wgmma needs sm_90a
            opts = kernels.OPTIONS + kernels.kernel_defines() + kernels.CUPY_ADDED_OPTIONS + (f"-arch={arch}",)
            try:
                nvrtc.compileProgram(prog, list(opts))
            except Exception as e:
                raise RuntimeError(f"{fname}: {e}\n{nvrtc.getProgramLog(prog)}") from e
            secs = elf_sections(bytes(nvrtc.getCUBIN(prog)))
            for n in names:
                low = nvrtc.getLoweredName(prog, n)
                text = secs[".text." + low]
                res[f"{fname}:{n}"] = {"sass_sha256": hashlib.sha256(text).hexdigest(), "bytes": len(text),
                                       "param_bank": len(secs.get(".nv.constant0." + low, b""))}
                print(f"{fname:22s} {n:44s} {len(text):7d} B  {res[f'{fname}:{n}']['sass_sha256'][:16]}",
                      flush=True)
        finally:
            nvrtc.destroyProgram(prog)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--root")
    d.add_argument("--only", default="", help="FILE:NAME;FILE:NAME;... (names may contain commas)")
    c = sub.add_parser("compare")
    c.add_argument("old")
    c.add_argument("new")
    c.add_argument("--map", default="", help="OLDKEY=NEWKEY,... (keys are FILE:NAME)")
    a = p.parse_args(argv)
    if a.cmd == "dump":
        if a.root:
            sys.path.insert(0, a.root)
            for m in [m for m in sys.modules if m == "engine" or m.startswith(("engine.", "kernels_cu"))]:
                del sys.modules[m]
        only = {tuple(x.split(":", 1)) for x in a.only.split(";") if x} or None
        with open(a.out, "w") as f:
            json.dump(dump(only), f, indent=1, sort_keys=True)
        return 0
    old, new = json.load(open(a.old)), json.load(open(a.new))
    ren = dict(x.split("=", 1) for x in a.map.split(",") if x)
    bad = 0
    for k, v in sorted(old.items()):
        nk = ren.get(k, k)
        w = new.get(nk)
        same = w is not None and w["sass_sha256"] == v["sass_sha256"]
        bad += not same
        print(f"{'same' if same else 'DIFF' if w else 'GONE'}  {k}" + (f" -> {nk}" if nk != k else "")
              + ("" if same or w is None else f"  ({v['bytes']} -> {w['bytes']} B, params "
                                                f"{v['param_bank']} -> {w['param_bank']} B)"))
    print(f"{len(old) - bad} of {len(old)} instances have the same machine code")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
