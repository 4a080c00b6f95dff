"""Load kernels_cu/*.cu, compile them with NVRTC through CuPy (per device, cached), and a
CPU-only compile check with the same source assembly, options and template instances.

Source assembly: each .cu file includes common.cuh (which includes numerics.cuh, the shared
float numerics) and the other kernels_cu headers it uses; each `#include "X.cuh"` of a kernels_cu
header is replaced, recursively and once per header, by the header's text between `#line` directives, so compiler messages name the real file and line, no include
path is needed, and CuPy's source-keyed kernel cache sees header edits.

Run time: `get_kernel(file, name)` -> engine.gpu.launch.Kernel (a cupy.RawKernel that launches
programmatically inside launch.capture_graph), compiled on first use for the current device
with `-arch` from the device (CuPy picks sm_XX from its compute capability and adds
`-ftz=true --device-as-default-execution-space`). Template kernels are instantiated through
`name_expressions`; engine.gpu.registry.INSTANCES lists every production instance.

CPU check: `compile_for_check(arch="sm_90")` runs NVRTC directly (cupy_backends), no driver,
with the options CuPy would use plus `--ptxas-options=-v`, and returns the ptxas resource
usage per instance (registers, stack frame, spill bytes).
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

import kernels_cu
from engine.gpu.launch import Kernel
# The production instances and the MMQ tile names / configurations live in engine.gpu.registry
# (a leaf module); re-exported here for the launchers and tests.
from engine.gpu.registry import (  # noqa: F401
    INSTANCES, MMQ_CONFIGS, MMQ_LAST_FIELD, MMQ_SPLIT_SUFFIX, MMSB_MAX_TOKENS, MMSB_VARIANT, MMVQ_VARIANT, instance_count, is_mmsb, mmq_config, mmq_instance,
    mmq_split_name, mmq_variants,
)

KERNEL_DIR = Path(kernels_cu.__file__).resolve().parent

# Options we pass; CuPy appends -arch=sm_XX, -ftz=true and --device-as-default-execution-space.
OPTIONS: tuple[str, ...] = ("--std=c++17",)
CUPY_ADDED_OPTIONS: tuple[str, ...] = ("-ftz=true", "--device-as-default-execution-space")

MMQ_NBUF = 2          # buffers per staged operand (common.cuh)

# Files with sm_90a-only instructions (wgmma): NVRTC builds PTX for compute_90a and the driver
# compiles it when the module loads (CuPy would add -arch=sm_90, and NVRTC 12.9's own sm_90a
# back end crashed on wgmma code on the CPU). They load only on compute capability 9.0.
SM90A_FILES = frozenset({"wgmma_q4_k.cu", "wgmma_q6_k.cu", "wgmma_pair.cu", "attention_wgmma.cu"})
SM90A_ARCH = "compute_90a"


def mmq_uses_tc(kind: str, variant: str) -> bool:
    """Whether the variant computes q4_K's min term on TF32 tensor cores (registry.MMQ_LAST_FIELD;
    never the decode GEMV, MMVQ_VARIANT)."""
    if variant == MMVQ_VARIANT:
        return False
    if is_mmsb(variant):      # mmsb_q4_k.cu: the min term on TF32, as MMQ
        return MMQ_LAST_FIELD.get(kind) == "tc"
    return MMQ_LAST_FIELD.get(kind) == "tc" and bool(mmq_config(kind, variant)[6])


def mmq_tile(kind: str, variant: str) -> tuple[int, int, int]:
    """(BM tokens, BN rows, threads) of a variant."""
    mt, nt, wm, wn, *_ = mmq_config(kind, variant)
    return wm * mt * 16, wn * nt * 8, wm * wn * 32


# Dynamic shared memory of the B operand per family, (BN, KS, NC = KS/32) -> bytes (mirrors
# Q4KLayout / Q6KLayout).
_MMQ_B_SMEM = {
    # qs planes + 2 x {dsc [NC][BN], m [NC][BN], -dmin [BN]} floats
    "q4_k": lambda bn, ks, nc: MMQ_NBUF * bn * (ks // 2) + 2 * (2 * nc * bn * 4 + bn * 4),
    # expanded B planes + 2 x float2 [NC][BN]
    "q6_k": lambda bn, ks, nc: MMQ_NBUF * bn * ks + MMQ_NBUF * nc * bn * 8,
}


def mmq_smem_bytes(kind: str, variant: str) -> int:
    """Dynamic shared memory of an MMQ instance (mirrors Q4KLayout / Q6KLayout; the kernel
    traps if it is given less)."""
    if kind not in _MMQ_B_SMEM:
        raise ValueError(f"unknown MMQ kind {kind!r}")
    bm, bn, _ = mmq_tile(kind, variant)
    ks = mmq_config(kind, variant)[5]
    nc = ks // 32
    return MMQ_NBUF * (bm * ks + bm * nc * 8) + _MMQ_B_SMEM[kind](bn, ks, nc)


# ----------------------------------------------------------------------------- source

def kernel_files() -> list[str]:
    return sorted(p.name for p in KERNEL_DIR.glob("*.cu"))


def source(fname: str) -> str:
    """The assembled source of kernels_cu/<fname>: its kernels_cu headers inlined with #line,
    recursively (common.cuh includes numerics.cuh), each header once (the first include); a
    .cu may include other .cu files for their device code (wgmma_pair.cu: both weight policies)."""
    out: list[str] = []
    _inline(KERNEL_DIR / fname, out, set())
    return "\n".join(out) + "\n"


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([\w.]+\.cuh?)"')


def _inline(path: Path, out: list[str], seen: set[str]) -> None:
    out.append(f'#line 1 "{path}"')
    for i, line in enumerate(path.read_text().splitlines()):
        m = _INCLUDE.match(line)
        if m:
            if m.group(1) not in seen:
                seen.add(m.group(1))
                _inline(KERNEL_DIR / m.group(1), out, seen)
            out.append(f'#line {i + 2} "{path}"')
        else:
            out.append(line)


# ----------------------------------------------------------------------------- run time

DEFINES_ENV = "GGUF_PREFILL_KERNEL_DEFINES"   # the A/B define sets' variable (dev/ab_bench, dev/attn_bench)


def kernel_defines() -> tuple[str, ...]:
    """GGUF_PREFILL_KERNEL_DEFINES="NAME=VALUE ..." (spaces or commas between entries: a comma
    list survives gpu_check.sh's `export`) -> NVRTC -D options: compile-time variants of a kernel
    measured side by side in one device call (gpu_check.sh step ab); unset in production. A
    malformed entry raises ValueError naming it."""
    return _parse_defines(os.environ.get(DEFINES_ENV, ""))


def file_defines(fname: str) -> tuple[str, ...]:
    """The kernel_defines() entries whose macro kernels_cu/<fname> (headers inlined) names: the
    options its build gets, so a define set rebuilds only the files it reaches (an A/B of
    attention_wgmma.cu's defines keeps every other kernel's build)."""
    return _file_defines(fname, kernel_defines())


@functools.lru_cache(maxsize=256)
def _file_defines(fname: str, defines: tuple[str, ...]) -> tuple[str, ...]:
    if not defines:
        return ()
    words = set(re.findall(r"\w+", source(fname)))
    return tuple(d for d in defines if d[2:].partition("=")[0] in words)


def parse_defines(text: str) -> tuple[str, ...]:
    """The NVRTC -D options of a GGUF_PREFILL_KERNEL_DEFINES text (ValueError naming a bad entry)."""
    return _parse_defines(text)


@functools.lru_cache(maxsize=8)
def _parse_defines(text: str) -> tuple[str, ...]:
    out = []
    for item in re.split(r"[\s,]+", text.strip()):
        if not item:
            continue
        if not re.fullmatch(r"[A-Za-z_]\w*(=[\w.+-]+)?", item):
            raise ValueError(f"GGUF_PREFILL_KERNEL_DEFINES: {item[:60]!r} is not NAME or NAME=VALUE")
        out.append(f"-D{item}")
    return tuple(out)


def define_value(name: str, default: int) -> int:
    """The integer a kernel_defines() entry NAME=VALUE gives a macro, else `default` (launchers
    whose launch shape follows a compile-time define)."""
    for opt in kernel_defines():
        key, _, value = opt[2:].partition("=")
        if key == name:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"GGUF_PREFILL_KERNEL_DEFINES: {name}={value!r} is not an integer") from None
    return default


# Compiled modules and kernels per (device, file, instance or name, file_defines): a process
# that changes GGUF_PREFILL_KERNEL_DEFINES between launches (dev/attn_bench, dev/ab_bench: define
# sets side by side in one process) gets each set's own build.
_modules: dict[tuple[int, str, str, tuple[str, ...]], object] = {}
_kernels: dict[tuple[int, str, str, tuple[str, ...]], object] = {}
_lowered: dict[tuple[int, str, str], str] = {}     # (device, file, name expression) -> symbol


def nvrtc_ptx(fname: str, names, arch: str = SM90A_ARCH) -> tuple[str, dict[str, str]]:
    """PTX of kernels_cu/<fname> for `arch` (a compute_XX target) through NVRTC, and the lowered
    symbol of each name expression; RuntimeError with the compiler log on a compile error."""
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(source(fname), fname, [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            opts = OPTIONS + file_defines(fname) + CUPY_ADDED_OPTIONS + (f"-arch={arch}",)
            nvrtc.compileProgram(prog, list(opts))
        except Exception as e:
            raise RuntimeError(f"{fname}: NVRTC compile failed: {e}\n{nvrtc.getProgramLog(prog)}") from e
        ptx = nvrtc.getPTX(prog)
        ptx = (ptx.decode() if isinstance(ptx, bytes) else ptx).rstrip("\0")
        return ptx, {n: nvrtc.getLoweredName(prog, n) for n in names}
    finally:
        nvrtc.destroyProgram(prog)


def _sm90a_module(fname: str, names: list[str]):
    """cupy.RawModule of an SM90A_FILES file: NVRTC PTX written to a private temporary file,
    loaded (and compiled for the device) by the driver."""
    import tempfile

    import cupy

    if cupy.cuda.Device().compute_capability != "90":
        raise RuntimeError(f"{fname} needs an sm_90 GPU (wgmma), this one is sm_{cupy.cuda.Device().compute_capability}")
    ptx, lowered = nvrtc_ptx(fname, names)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        mod = cupy.RawModule(path=f.name)
        for n, sym in lowered.items():
            mod.get_function(sym)          # load now, while the file exists
    finally:
        os.unlink(f.name)
    return mod, lowered


def get_module(fname: str, instance: str | None = None):
    """cupy.RawModule of kernels_cu/<fname> for the current device. With `instance` (a
    template instance such as 'mmq_q4_k<...>') only that instance is compiled, so a process
    compiles just the tile variants it launches; without it, every listed instance."""
    import cupy

    dev = cupy.cuda.Device().id
    key = (dev, fname, instance or "", file_defines(fname))
    mod = _modules.get(key)
    if mod is None:
        names = [instance] if instance else list(INSTANCES.get(fname, ()))
        if fname in SM90A_FILES:
            mod, lowered = _sm90a_module(fname, names)
            _lowered.update({(dev, fname, n): sym for n, sym in lowered.items()})
        else:
            mod = cupy.RawModule(code=source(fname), options=OPTIONS + file_defines(fname),
                                 name_expressions=names or None)
            mod.compile()
        _bind_timeline(mod)
        _modules[key] = mod
    return mod


TIMELINE_CAP = 65536     # common.cuh KERNEL_TL_CAP: stamps the buffer holds
_timeline: dict[int, object] = {}


def timeline_buffer():
    """KERNEL_TIMELINE builds (a diagnostic define; dev/graph_timeline.py): this device's stamp
    buffer, uint64 [1 + 2 TIMELINE_CAP], that every module's ggp_tl_buf points at: word 0 counts
    the stamps, words 1 + 2 i and 2 + 2 i hold the i-th (%globaltimer ns, grid / block signature:
    common.cuh kernel_tl_stamp). Zero word 0 to start a record."""
    import cupy

    dev = cupy.cuda.Device().id
    if dev not in _timeline:
        _timeline[dev] = cupy.zeros(1 + 2 * TIMELINE_CAP, dtype=cupy.uint64)
    return _timeline[dev]


def _bind_timeline(mod) -> None:
    """Point a KERNEL_TIMELINE module's ggp_tl_buf at timeline_buffer() (nothing otherwise)."""
    if not define_value("KERNEL_TIMELINE", 0):
        return
    import cupy

    ptr = cupy.ndarray((1,), dtype=cupy.uint64, memptr=mod.get_global("ggp_tl_buf"))
    ptr[0] = timeline_buffer().data.ptr


def get_kernel(fname: str, name: str, dynamic_smem: int = 0) -> Kernel:
    """Kernel `name` of kernels_cu/<fname> for the current device (engine.gpu.launch.Kernel: a
    cupy.RawKernel that launches programmatically inside launch.capture_graph); raises the
    dynamic shared-memory limit to `dynamic_smem` when that is over the 48 KB default."""
    import cupy

    dev = cupy.cuda.Device().id
    key = (dev, fname, name, file_defines(fname))
    k = _kernels.get(key)
    if k is None:
        mod = get_module(fname, name if "<" in name or fname in SM90A_FILES else None)
        k = Kernel(mod.get_function(_lowered.get((dev, fname, name), name)))
        _kernels[key] = k
    if dynamic_smem > 48 * 1024 and k.max_dynamic_shared_size_bytes < dynamic_smem:
        k.max_dynamic_shared_size_bytes = dynamic_smem
    return k


# ----------------------------------------------------------------------------- CPU check

@dataclass(frozen=True)
class Resources:
    file: str
    name: str
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int
    pdl_wait: bool = False     # the entry's PTX has griddepcontrol.wait (common.cuh pdl_entry)

    def line(self) -> str:
        return (f"{self.file:22s} {self.name:34s} regs {self.registers:4d}  stack {self.stack:5d} B"
                f"  spill st/ld {self.spill_stores}/{self.spill_loads} B" + ("" if self.pdl_wait else "  NO PDL WAIT"))


class NVRTCMissing(RuntimeError):
    pass


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as e:  # pragma: no cover - depends on the environment
        raise NVRTCMissing(f"cupy_backends NVRTC bindings unavailable: {e}") from e
    try:
        nvrtc.getVersion()
    except Exception as e:  # pragma: no cover
        raise NVRTCMissing(f"NVRTC library not loadable: {e}") from e
    return nvrtc


def parse_ptxas_log(log: str) -> dict[str, dict[str, int]]:
    """ptxas -v output -> {mangled name: {registers, stack, spill_stores, spill_loads}}."""
    res: dict[str, dict[str, int]] = {}
    cur = None
    for line in log.splitlines():
        m = re.search(r"Function properties for (\S+)", line) or \
            re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = m.group(1)
            res.setdefault(cur, {})
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            res[cur].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                            spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            res[cur]["registers"] = int(m.group(1))
    return res


def ptx_entries_waiting(ptx: str) -> set[str]:
    """Names of the PTX entry functions whose body has griddepcontrol.wait."""
    out, cur = set(), None
    for line in ptx.splitlines():
        m = re.match(r"\s*(?:\.(?:visible|weak)\s+)*\.entry\s+([\w$]+)", line)
        if m:
            cur = m.group(1)
        elif cur is not None and "griddepcontrol.wait" in line:
            out.add(cur)
    return out


def compile_for_check(arch: str = "sm_90", files: list[str] | None = None) -> list[Resources]:
    """Compile every kernel file (or `files`) for `arch` with NVRTC on the CPU; raise
    RuntimeError with the compiler log on a compile error; return per-instance resources
    (and whether each entry waits for its predecessor grid: Resources.pdl_wait)."""
    nvrtc = _nvrtc()
    out: list[Resources] = []
    for fname in files or kernel_files():
        names = INSTANCES.get(fname, ())
        if fname in SM90A_FILES:
            out += _check_sm90a(fname, names)
            continue
        src = source(fname)
        prog = nvrtc.createProgram(src, fname, [], [])
        try:
            for n in names:
                nvrtc.addNameExpression(prog, n)
            opts = OPTIONS + kernel_defines() + CUPY_ADDED_OPTIONS + (f"-arch={arch}", "--ptxas-options=-v")
            try:
                nvrtc.compileProgram(prog, list(opts))
            except Exception as e:
                raise RuntimeError(f"{fname}: NVRTC compile failed: {e}\n{nvrtc.getProgramLog(prog)}") from e
            log = nvrtc.getProgramLog(prog)
            usage = parse_ptxas_log(log)
            ptx = nvrtc.getPTX(prog)
            waiting = ptx_entries_waiting(ptx.decode() if isinstance(ptx, bytes) else ptx)
            if not names:   # no listed instances: report every entry function ptxas built
                for lowered, u in sorted(usage.items()):
                    if "registers" in u:
                        out.append(Resources(fname, lowered, u["registers"], u.get("stack", 0),
                                             u.get("spill_stores", 0), u.get("spill_loads", 0),
                                             lowered in waiting))
            for n in names:
                lowered = nvrtc.getLoweredName(prog, n)
                u = usage.get(lowered)
                if u is None or "registers" not in u:
                    raise RuntimeError(f"{fname}: no ptxas usage for {n} ({lowered}) in log:\n{log}")
                out.append(Resources(fname, n, u["registers"], u.get("stack", 0),
                                     u.get("spill_stores", 0), u.get("spill_loads", 0), lowered in waiting))
        finally:
            nvrtc.destroyProgram(prog)
    return out


def _check_sm90a(fname: str, names) -> list[Resources]:
    """compile_for_check of an SM90A_FILES file: NVRTC PTX for compute_90a; resources from a
    `ptxas` (GGUF_PREFILL_PTXAS or on PATH, e.g. the nvidia-cuda-nvcc wheel's) when there is one,
    else registers = 0 (the PTX compiled: the front end and the target checks passed)."""
    import shutil
    import subprocess
    import tempfile

    ptx, lowered = nvrtc_ptx(fname, names)
    waiting = ptx_entries_waiting(ptx)
    usage: dict[str, dict[str, int]] = {}
    ptxas = os.environ.get("GGUF_PREFILL_PTXAS") or shutil.which("ptxas")
    if ptxas:
        with tempfile.TemporaryDirectory() as d:
            Path(d, "k.ptx").write_text(ptx)
            r = subprocess.run([ptxas, "-arch=sm_90a", "-v", "k.ptx", "-o", "k.cubin"], cwd=d,
                               capture_output=True, text=True, timeout=300)
            if r.returncode:
                raise RuntimeError(f"{fname}: ptxas failed:\n{r.stderr[-4000:]}")
            usage = parse_ptxas_log(r.stderr + r.stdout)
    return [Resources(fname, n, usage.get(sym, {}).get("registers", 0), usage.get(sym, {}).get("stack", 0),
                      usage.get(sym, {}).get("spill_stores", 0), usage.get(sym, {}).get("spill_loads", 0),
                      sym in waiting) for n, sym in lowered.items()]


def count_line() -> str:
    """'N instances: file n, ...' of the registry (printed by the compile check)."""
    c = instance_count()
    return f"{sum(c.values())} kernel instances: " + ", ".join(f"{f} {n}" for f, n in c.items())


if __name__ == "__main__":  # python -m engine.gpu.kernels: print the sm_90 resource table
    print(count_line())
    for r in compile_for_check():
        print(r.line())
