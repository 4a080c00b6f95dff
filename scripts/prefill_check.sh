#!/usr/bin/env bash
# One device call for the GPU prefill (issue 4): prefill kernel tests, whole-model logits vs the
# numpy reference (tiny, tiny-qwen2, the real-weight slice in .gpu_data/), then `bench` on a
# synthetic llama2-7b q4_K_M generated on the device, and a short summary last.
#
#   device: run(command="bash scripts/prefill_check.sh", carry=[".whl", ".gpu_data"])
#   PREFILL_STEPS="kernels mmq model bench" (default) selects sections.
#   BENCH_ARGS (default "-p 512,3314 -r 5 --breakdown") are passed to the bench verb.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/.gpu_out}"
mkdir -p "$OUT"
export GPU_REPORT="$OUT/prefill_report.jsonl"
: > "$GPU_REPORT"
STATUS=0
if ! python3 -c "import gguf" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}" \
      || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
section() { echo; echo "=================== $* ($(date +%T))"; }

step_kernels() {
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_gpu_model.py \
      -k "embed or rmsnorm or swiglu or rope or attention" 2>&1 | tee "$OUT/pytest_kernels.log" | tail -25
  return "${PIPESTATUS[0]}"
}

# The MMQ GEMMs exactly as the forward dispatches them (engine.gpu.ops.mmq default variants).
step_mmq() {
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_gpu_mmq.py -k "dispatch" 2>&1 \
      | tee "$OUT/pytest_mmq.log" | tail -5
  return "${PIPESTATUS[0]}"
}

step_model() {
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE -s tests/test_gpu_model.py \
      -k "forward or resident" 2>&1 | tee "$OUT/pytest_model.log" | grep -v '^{' | tail -25
  return "${PIPESTATUS[0]}"
}

step_bench() {
  local m=/tmp/l7b.gguf
  [ -f "$m" ] || timeout 120 python3 -m engine synth --shape llama2-7b --random-blocks "$m" || return 1
  ls -l "$m"
  timeout 300 python3 -m engine bench --model "$m" --device gpu ${BENCH_ARGS:--p 512,3314 -r 5 --breakdown} \
      --json > "$OUT/bench.json" 2> "$OUT/bench.err"
  local rc=$?
  tr '\r' '\n' < "$OUT/bench.err" | grep -v '^$' | tail -6
  return $rc
}

for s in ${PREFILL_STEPS:-kernels mmq model bench}; do
  section "$s"
  "step_$s" || { echo "!! step $s failed (rc $?)"; STATUS=1; }
done
section summary
python3 scripts/prefill_summary.py "$OUT" || STATUS=1
exit $STATUS
