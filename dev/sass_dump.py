"""SASS of one kernel instance, built on the CPU (NVRTC PTX -> ptxas -> nvdisasm): instruction
counts by opcode, so a kernel change's instruction mix is read without device time.

    python -m dev.sass_dump mmsb_q4_k.cu "mmsb_q4_k<4, 2, 2>" [--sass] [--loop] [--ctrl] [--tools DIR ...]

ptxas: the `nvidia-cuda-nvcc-cu12` wheel's bin/ptxas (the NVRTC of the same CUDA release, so
the registers match ptxas's -v of the run-time build); nvdisasm: the `nvidia-cuda-nvdisasm`
wheel's. Neither is a dependency: `pip download --no-deps` them and unzip; --tools names the
folders searched (default: PATH).
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from engine.gpu import kernels


def find_tool(name: str, dirs: list[str]) -> str:
    for d in dirs:
        for p in Path(d).rglob(name):
            if p.is_file():
                return str(p)
    found = shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found in {dirs or 'PATH'}")
    return found


def ptx(fname: str, instance: str, arch: str = "compute_90") -> tuple[str, str]:
    """(ptx text, lowered name) of one instance."""
    nvrtc = kernels._nvrtc()
    prog = nvrtc.createProgram(kernels.source(fname), fname, [], [])
    try:
        nvrtc.addNameExpression(prog, instance)
        opts = kernels.OPTIONS + kernels.kernel_defines() + kernels.CUPY_ADDED_OPTIONS + (f"-arch={arch}",)
        try:
            nvrtc.compileProgram(prog, list(opts))
        except Exception as e:
            raise SystemExit(f"{fname}: NVRTC compile failed: {e}\n{nvrtc.getProgramLog(prog)}") from None
        text = nvrtc.getPTX(prog)
        text = text.decode() if isinstance(text, bytes) else text
        return text.rstrip("\0"), nvrtc.getLoweredName(prog, instance)
    finally:
        nvrtc.destroyProgram(prog)


def control_listing(hex_sass: str) -> str:
    """`nvdisasm -hex` output as one line per instruction with its scheduling control bits
    (sm_90's upper 64-bit word: stall cycles at bit 41, write / read scoreboard at 46 / 49 (7 =
    none), wait mask at 52): which scoreboard a load sets and which instruction waits on it."""
    lines, out = hex_sass.splitlines(), []
    for i, line in enumerate(lines[:-1]):
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?);\s*/\*\s*0x[0-9a-f]+\s*\*/", line)
        hi = re.search(r"/\*\s*(0x[0-9a-f]+)\s*\*/", lines[i + 1]) if m else None
        if not hi:
            continue
        w = int(hi.group(1), 16)
        stall, wb, rb, wait = (w >> 41) & 0xF, (w >> 46) & 7, (w >> 49) & 7, (w >> 52) & 0x3F
        sb = lambda v: "-" if v == 7 else str(v)
        waits = "".join(str(b) for b in range(6) if wait >> b & 1) or "-"
        out.append(f"{m.group(1)}  stall {stall:2d}  wr {sb(wb)}  rd {sb(rb)}  wait {waits:6s}  {m.group(2)}")
    return "\n".join(out)


def opcode_counts(sass: str) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*(?:/\*[0-9a-f]+\*/)?\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[ .;]", line)
        if m:
            counts[m.group(1)] += 1
    return counts


def main_loop_counts(sass: str) -> collections.Counter:
    """Opcode counts of one pass of the kernel's main loop: of the backward branches, the one
    whose body holds the most tensor-core instructions (HGMMA / HMMA / IMMA), the shortest such
    body on a tie (the K loop of a GEMM, not a branch around it); empty if there is none."""
    lines = sass.splitlines()
    labels = {l.rstrip(":"): i for i, l in enumerate(lines) if re.match(r"\.L_x_\d+:", l)}
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            body = "\n".join(lines[labels[m.group(1)]:i + 1])
            key = (len(re.findall(r"\b(?:HGMMA|HMMA|IMMA)\b", body)), labels[m.group(1)] - i)
            if key[0] and (best is None or key > best[0]):
                best = (key, body)
    return opcode_counts(best[1]) if best else collections.Counter()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("instance")
    ap.add_argument("--tools", nargs="*", default=[])
    ap.add_argument("--sass", action="store_true", help="print the whole listing")
    ap.add_argument("--loop", action="store_true", help="also the opcode counts of one pass of the main (K) loop")
    ap.add_argument("--ctrl", action="store_true", help="print the listing with each instruction's control bits "
                    "(stall, the scoreboards it sets, the ones it waits on)")
    a = ap.parse_args()
    arch = "90a" if a.file in kernels.SM90A_FILES else "90"     # wgmma needs the arch-specific target
    text, lowered = ptx(a.file, a.instance, f"compute_{arch}")
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.ptx").write_text(text)
        log = subprocess.run([find_tool("ptxas", a.tools), f"-arch=sm_{arch}", "-v", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                             check=True, capture_output=True, text=True).stderr
        sass = subprocess.run([find_tool("nvdisasm", a.tools), "-c", f"{d}/k.cubin"], check=True,
                              capture_output=True, text=True).stdout
        if a.ctrl:
            print(control_listing(subprocess.run([find_tool("nvdisasm", a.tools), "-c", "-hex", f"{d}/k.cubin"],
                                                 check=True, capture_output=True, text=True).stdout))
    if a.sass:
        print(sass)
    counts = opcode_counts(sass)
    print(" ".join(l.strip() for l in log.splitlines() if "Used" in l or "spill" in l))
    depbar, hgmma = sass.count("WARPGROUP.DEPBAR"), sass.count("HGMMA")
    if hgmma and depbar >= hgmma:                  # ptxas serializes wgmma silently (a wait after each)
        print(f"warning: wgmma serialized ({depbar} WARPGROUP.DEPBAR for {hgmma} HGMMA)")
    for line in log.splitlines():                  # ptxas's own warnings
        if "warning" in line.lower():
            print(line.strip())
    print(f"{a.instance}: {sum(counts.values())} instructions (static)")
    print("  " + "  ".join(f"{op} {n}" for op, n in counts.most_common()))
    if a.loop:
        loop = main_loop_counts(sass)
        print(f"main loop, one pass: {sum(loop.values())} instructions")
        print("  " + "  ".join(f"{op} {n}" for op, n in loop.most_common()))


if __name__ == "__main__":
    main()
