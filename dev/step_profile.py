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

if npl == 0:                           # prompt forwards: `bench -p depth`
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, depth).tolist()
    cache = model.new_cache(depth)
    for _ in range(2):                           # kernels loaded, prefill graph recorded
        cache.length = 0
        model.forward_device(ids, cache)
    cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.profiler.start()
    for _ in range(steps):
        cache.length = 0
        model.forward_device(ids, cache)
    cupy.cuda.runtime.deviceSynchronize()
    cupy.cuda.profiler.stop()
    print(f"step_profile: {steps} prompt forwards of {depth} tokens")
    raise SystemExit(0)
if npl == 1:                           # single stream: the decode graph of `bench -n` (DecodeStep)
    from engine.gpu.decode import DecodeStep

    cache = model.new_cache(depth + steps + 4)
    if depth:
        model.forward_device(np.random.default_rng(0).integers(0, model.config.vocab_size, depth).tolist(), cache)
    step = DecodeStep(model, cache)
    step.chain(1, depth, 2)                      # kernels loaded, graph recorded
    with step.stream:
        step.set_state(1, depth)
    step.stream.synchronize()
    cupy.cuda.profiler.start()
    with step.stream:
        for _ in range(steps):
            step.graph.launch(step.stream)
    step.stream.synchronize()
    cupy.cuda.profiler.stop()
    print(f"step_profile: single stream at depth {depth}, {steps} graph replays")
    raise SystemExit(0)
batch = model.batch(npl, depth + steps + 4)
rng = np.random.default_rng(0)
V = model.config.vocab_size
for i in range(npl):
    batch.run([BatchEntry(i, rng.integers(0, V, depth).tolist(), 0, None)])
toks = [int(t) for t in rng.integers(0, V, npl)]

for k in range(steps + 2):                       # two warm-up steps (the first records the graph)
    if k == 2:
        cupy.cuda.runtime.deviceSynchronize()
        cupy.cuda.profiler.start()
    outs = batch.run([BatchEntry(i, [toks[i]], depth + k, "argmax") for i in range(npl)])
    toks = [o[0] for o in outs]
cupy.cuda.profiler.stop()
print(f"step_profile: {npl} slots at depth {depth}, {steps} steps, "
      f"last device ms {batch.last_device_seconds * 1e3:.3f}")
