"""Per-launch timing for the GPU backend: CUDA events around every launch, summed per op kind.

    timer = OpTimer()
    model.profile(timer)          # engine.gpu.model.GPUModel brackets each launch with timer.span(kind)
    model.forward_device(ids, cache)
    model.profile(None)
    timer.totals_ms(), timer.counts()

Without an attached timer the model records nothing (a shared nullcontext per launch).
"""
from __future__ import annotations


def _cp():
    import cupy

    return cupy


class OpTimer:
    """CUDA events around every launch, summed per op kind after a synchronize."""

    def __init__(self):
        self.spans: list[tuple[str, object, object]] = []

    def span(self, kind: str) -> "_Span":
        return _Span(self, kind)

    def totals_ms(self) -> dict[str, float]:
        cp = _cp()
        if self.spans:
            self.spans[-1][2].synchronize()
        out: dict[str, float] = {}
        for kind, a, b in self.spans:
            out[kind] = out.get(kind, 0.0) + cp.cuda.get_elapsed_time(a, b)
        return out

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for kind, _, _ in self.spans:
            out[kind] = out.get(kind, 0) + 1
        return out


class _Span:
    __slots__ = ("timer", "kind", "a")

    def __init__(self, timer: OpTimer, kind: str):
        self.timer, self.kind = timer, kind

    def __enter__(self):
        cp = _cp()
        self.a = cp.cuda.Event()
        self.a.record()
        return self

    def __exit__(self, *exc):
        cp = _cp()
        b = cp.cuda.Event()
        b.record()
        self.timer.spans.append((self.kind, self.a, b))
        return False
