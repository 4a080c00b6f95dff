"""Launch sequence of batched decode steps for a kernel-level profiler (nsys or ncu): a model,
a GPUBatch of NPL slots holding DEPTH random tokens each, then STEPS decode-only steps of NPL
tokens (graph replays), one step at a time; NPL = 1: the single-stream decode graph (DecodeStep,
`bench -n`'s) after DEPTH tokens of context, STEPS replays back to back; NPL = 0: STEPS prompt
forwards of DEPTH tokens (`bench -p DEPTH`'s, a prefill graph up to its size). The profiler gives each
kernel's time in the step with no event overhead (engine.gpu.profiler's per-launch events cost
more than the small kernels they time).

    nsys profile --capture-range=cudaProfilerApi --cuda-graph-trace=node -o step \\
        python3 -m dev.step_profile M.gguf 32 256 20 [BLOCKS_PER_SM]
    nsys stats --report cuda_gpu_kern_sum step.nsys-rep
"""
import sys

import numpy as np

from engine.loader import load_model
from engine.scheduler import BatchEntry

path = sys.argv[1]
npl, depth, steps = (int(a) for a in sys.argv[2:5]) if len(sys.argv) > 4 else (32, 256, 20)
if len(sys.argv) > 5:                  # experiment: decode-row attention blocks per SM (key splits)
    from engine.gpu import ops

    ops.attention.VARLEN_BLOCKS_PER_SM = int(sys.argv[5])
model = load_model(path, device="gpu")
import cupy  # noqa: E402

rng = np.random.default_rng(0)
V = model.config.vocab_size


def profiled(run, n: int) -> None:
    """n calls of run() between the profiler's start and stop, the device idle at both."""
    cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.profiler.start()
    for _ in range(n):
        run()
    cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.profiler.stop()


if npl == 0:                           # prompt forwards: `bench -p depth`
    ids = rng.integers(0, V, depth).tolist()
    cache = model.new_cache(depth)

    def forward():
        cache.length = 0
        model.forward_device(ids, cache)

    forward()
    forward()                                    # kernels loaded, prefill graph recorded
    profiled(forward, steps)
    print(f"step_profile: {steps} prompt forwards of {depth} tokens")
elif npl == 1:                         # single stream: the decode graph of `bench -n` (DecodeStep)
    from engine.gpu.decode import DecodeStep

    cache = model.new_cache(depth + steps + 4)
    if depth:
        model.forward_device(rng.integers(0, V, depth).tolist(), cache)
    step = DecodeStep(model, cache)
    step.chain(1, depth, 2)                      # kernels loaded, graph recorded
    with step.stream:
        step.set_state(1, depth)
    profiled(lambda: step.graph.launch(step.stream), steps)
    print(f"step_profile: single stream at depth {depth}, {steps} graph replays")
else:                                  # batched decode-only steps of npl slots
    batch = model.batch(npl, depth + steps + 4)
    for i in range(npl):
        batch.run([BatchEntry(i, rng.integers(0, V, depth).tolist(), 0, None)])
    toks, pos = [int(t) for t in rng.integers(0, V, npl)], depth

    def batch_step():                            # one token per slot, its argmax fed to the next step
        global toks, pos
        toks = [o[0] for o in batch.run([BatchEntry(i, [toks[i]], pos, "argmax") for i in range(npl)])]
        pos += 1

    batch_step()
    batch_step()                                 # two warm-up steps (the first records the graph)
    profiled(batch_step, steps)
    print(f"step_profile: {npl} slots at depth {depth}, {steps} steps, "
          f"last device ms {batch.last_device_seconds * 1e3:.3f}")
