"""Load kernels_cu/*.cu, compile them with NVRTC through CuPy (per device, cached), and a
CPU-only compile check with the same source assembly, options and template instances.

Source assembly: each .cu file includes "common.cuh" (and the decode kernels
"decode_common.cuh"); each `#include "X.cuh"` of a kernels_cu header is replaced by the header's
text between `#line` directives, so compiler messages name the real file and line, no include
path is needed, and CuPy's source-keyed kernel cache sees header edits.

Run time: `get_kernel(file, name)` -> cupy.RawKernel, compiled on first use for the current
device with `-arch` from the device (CuPy picks sm_XX from its compute capability and adds
`-ftz=true --device-as-default-execution-space`). Template kernels are instantiated through
`name_expressions` (INSTANCES lists them).

CPU check: `compile_for_check(arch="sm_90")` runs NVRTC directly (cupy_backends), no driver,
with the options CuPy would use plus `--ptxas-options=-v`, and returns the ptxas resource
usage per instance (registers, stack frame, spill bytes).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import kernels_cu

KERNEL_DIR = Path(kernels_cu.__file__).resolve().parent

# Options we pass; CuPy appends -arch=sm_XX, -ftz=true and --device-as-default-execution-space.
OPTIONS: tuple[str, ...] = ("--std=c++17",)
CUPY_ADDED_OPTIONS: tuple[str, ...] = ("-ftz=true", "--device-as-default-execution-space")

# MMQ kernel configurations per family: name -> (MT, NT, WM, WN, MINB, KS, TC).
# Warp tile (16 MT) tokens x (8 NT) rows, WM x WN warps, block tile BM = 16 MT WM tokens x
# BN = 8 NT WN rows, __launch_bounds__ minimum blocks per SM = MINB, KS k per pipeline stage
# (128 = half a super-block, 256 = one), then for q4_K TC: the min term per stage on TF32
# tensor cores instead of one FFMA per output and block; for q6_K UNR: the compute loop's
# unroll over the stage's q8_1 blocks. Measured in docs/perf-log.md.
MMQ_CONFIGS: dict[str, dict[str, tuple[int, int, int, int, int, int, int]]] = {
    "q4_k": {
        "m64n128": (2, 4, 2, 4, 2, 128, 0),         # 8 warps of 32x32, 2 blocks/SM
        "m64n128tc": (2, 4, 2, 4, 2, 128, 1),
        "m64n128tc_k256": (2, 4, 2, 4, 2, 256, 1),
        "m128n128w8tc": (4, 4, 2, 4, 1, 128, 1),    # 8 warps of 64x32, 1 block/SM
        "m128n128w8tc_k256": (4, 4, 2, 4, 1, 256, 1),
    },
    "q6_k": {   # last field: UNR, the compute loop's unroll over q8_1 blocks
        "m64n128": (2, 4, 2, 4, 2, 128, 1),
        "m128n128w8": (4, 4, 2, 4, 1, 128, 1),
        "m128n128w8_k256": (4, 4, 2, 4, 1, 256, 1),
        "m128n128w8_k256u2": (4, 4, 2, 4, 1, 256, 2),
    },
}
MMQ_NBUF = 2          # buffers per staged operand (common.cuh)


def mmq_variants(kind: str) -> list[str]:
    """Variant names compiled (and tested, benchmarked) for a kernel family."""
    return list(MMQ_CONFIGS[kind])


# A variant name may end in MMQ_SPLIT_SUFFIX: the same tile configuration launched with the tail
# split (the tiles of the last, partial wave cut along K: engine.gpu.ops.mmq.split_plan), i.e. its
# whole-tile instance, then its split-part instance (mmq_instance(..., split_part=True)).
MMQ_SPLIT_SUFFIX = "+split"


def mmq_split_name(variant: str) -> tuple[str, bool]:
    """(MMQ_CONFIGS name, tail split?) of a variant name."""
    if variant.endswith(MMQ_SPLIT_SUFFIX):
        return variant[: -len(MMQ_SPLIT_SUFFIX)], True
    return variant, False


def mmq_config(kind: str, variant: str) -> tuple[int, int, int, int, int, int, int]:
    try:
        return MMQ_CONFIGS[kind][mmq_split_name(variant)[0]]
    except KeyError:
        raise KeyError(f"unknown MMQ variant {variant!r} for {kind} "
                       f"(have {', '.join(MMQ_CONFIGS.get(kind, {}))}, each also with "
                       f"{MMQ_SPLIT_SUFFIX})") from None


def mmq_instance(kind: str, variant: str, split_part: bool = False) -> str:
    """Template instance of a variant: split_part=False the whole-tile kernel, True the one
    that computes the K-parts of split tiles (the "+split" launch uses both)."""
    mt, nt, wm, wn, minb, ks, tc = mmq_config(kind, variant)
    return f"mmq_{kind}<{mt}, {nt}, {wm}, {wn}, {minb}, {ks}, {tc}, {str(split_part).lower()}>"


def mmq_uses_tc(kind: str, variant: str) -> bool:
    return kind == "q4_k" and bool(mmq_config(kind, variant)[6])


def mmq_tile(kind: str, variant: str) -> tuple[int, int, int]:
    """(BM tokens, BN rows, threads) of a variant."""
    mt, nt, wm, wn, *_ = mmq_config(kind, variant)
    return wm * mt * 16, wn * nt * 8, wm * wn * 32


def mmq_smem_bytes(kind: str, variant: str) -> int:
    """Dynamic shared memory of an MMQ instance (mirrors Q4KLayout / Q6KLayout; the kernel
    traps if it is given less)."""
    bm, bn, _ = mmq_tile(kind, variant)
    ks = mmq_config(kind, variant)[5]
    nc = ks // 32
    a = MMQ_NBUF * (bm * ks + bm * nc * 8)
    if kind == "q4_k":     # qs planes + 2 x {dsc [NC][BN], m [NC][BN], -dmin [BN]} floats
        return a + MMQ_NBUF * bn * (ks // 2) + 2 * (2 * nc * bn * 4 + bn * 4)
    if kind == "q6_k":     # expanded B planes + 2 x float2 [NC][BN]
        return a + MMQ_NBUF * bn * ks + MMQ_NBUF * nc * bn * 8
    raise ValueError(f"unknown MMQ kind {kind!r}")


INSTANCES: dict[str, tuple[str, ...]] = {
    "quantize_q8_1.cu": ("quantize_q8_1",),
    "q6k_expand_check.cu": ("q6k_expand_check",),
    "mmq_q4_k.cu": tuple(mmq_instance("q4_k", v, sp) for v in mmq_variants("q4_k") for sp in (False, True)),
    "mmq_q6_k.cu": tuple(mmq_instance("q6_k", v, sp) for v in mmq_variants("q6_k") for sp in (False, True)),
}
try:  # decode-step kernels (engine/gpu/decode_instances.py is a leaf module listing their names)
    from engine.gpu.decode_instances import DECODE_INSTANCES as _DECODE_INSTANCES
except ImportError:  # pragma: no cover - absent in trees without the decode kernels
    _DECODE_INSTANCES = {}
INSTANCES.update(_DECODE_INSTANCES)
# Prefill kernels (engine/gpu/model.py): extern "C" names listed in a leaf module.
from engine.gpu.prefill_instances import PREFILL_INSTANCES  # noqa: E402
INSTANCES.update(PREFILL_INSTANCES)


# ----------------------------------------------------------------------------- source

def kernel_files() -> list[str]:
    return sorted(p.name for p in KERNEL_DIR.glob("*.cu"))


def source(fname: str) -> str:
    """The assembled source of kernels_cu/<fname> (its kernels_cu headers inlined with #line)."""
    path = KERNEL_DIR / fname
    out = [f'#line 1 "{path}"']
    inc = re.compile(r'^\s*#\s*include\s+"([\w.]+\.cuh)"')
    for i, line in enumerate(path.read_text().splitlines()):
        m = inc.match(line)
        if m:
            header_path = KERNEL_DIR / m.group(1)
            out.append(f'#line 1 "{header_path}"')
            out.extend(header_path.read_text().splitlines())
            out.append(f'#line {i + 2} "{path}"')
        else:
            out.append(line)
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- run time

_modules: dict[tuple[int, str, str], object] = {}
_kernels: dict[tuple[int, str, str], object] = {}


def get_module(fname: str, instance: str | None = None):
    """cupy.RawModule of kernels_cu/<fname> for the current device. With `instance` (a
    template instance such as 'mmq_q4_k<...>') only that instance is compiled, so a process
    compiles just the tile variants it launches; without it, every listed instance."""
    import cupy

    dev = cupy.cuda.Device().id
    key = (dev, fname, instance or "")
    mod = _modules.get(key)
    if mod is None:
        names = [instance] if instance else list(INSTANCES.get(fname, ()))
        mod = cupy.RawModule(code=source(fname), options=OPTIONS, name_expressions=names or None)
        mod.compile()
        _modules[key] = mod
    return mod


def get_kernel(fname: str, name: str, dynamic_smem: int = 0):
    """cupy.RawKernel `name` of kernels_cu/<fname> for the current device; raises the dynamic
    shared-memory limit to `dynamic_smem` when that is over the 48 KB default."""
    import cupy

    dev = cupy.cuda.Device().id
    key = (dev, fname, name)
    k = _kernels.get(key)
    if k is None:
        mod = get_module(fname, name if "<" in name else None)
        k = mod.get_function(name)
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

    def line(self) -> str:
        return (f"{self.file:22s} {self.name:34s} regs {self.registers:4d}  stack {self.stack:5d} B"
                f"  spill st/ld {self.spill_stores}/{self.spill_loads} B")


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


def compile_for_check(arch: str = "sm_90", files: list[str] | None = None) -> list[Resources]:
    """Compile every kernel file (or `files`) for `arch` with NVRTC on the CPU; raise
    RuntimeError with the compiler log on a compile error; return per-instance resources."""
    nvrtc = _nvrtc()
    out: list[Resources] = []
    for fname in files or kernel_files():
        names = INSTANCES.get(fname, ())
        src = source(fname)
        prog = nvrtc.createProgram(src, fname, [], [])
        try:
            for n in names:
                nvrtc.addNameExpression(prog, n)
            opts = OPTIONS + CUPY_ADDED_OPTIONS + (f"-arch={arch}", "--ptxas-options=-v")
            try:
                nvrtc.compileProgram(prog, list(opts))
            except Exception as e:
                raise RuntimeError(f"{fname}: NVRTC compile failed: {e}\n{nvrtc.getProgramLog(prog)}") from e
            log = nvrtc.getProgramLog(prog)
            usage = parse_ptxas_log(log)
            if not names:   # no listed instances: report every entry function ptxas built
                for lowered, u in sorted(usage.items()):
                    if "registers" in u:
                        out.append(Resources(fname, lowered, u["registers"], u.get("stack", 0),
                                             u.get("spill_stores", 0), u.get("spill_loads", 0)))
            for n in names:
                lowered = nvrtc.getLoweredName(prog, n)
                u = usage.get(lowered)
                if u is None or "registers" not in u:
                    raise RuntimeError(f"{fname}: no ptxas usage for {n} ({lowered}) in log:\n{log}")
                out.append(Resources(fname, n, u["registers"], u.get("stack", 0),
                                     u.get("spill_stores", 0), u.get("spill_loads", 0)))
        finally:
            nvrtc.destroyProgram(prog)
    return out


if __name__ == "__main__":  # python -m engine.gpu.kernels: print the sm_90 resource table
    for r in compile_for_check():
        print(r.line())
