#!/usr/bin/env bash
# Device run for the GPU decode path (issues 7, 11): decode + session tests, tg128 on a synthetic
# llama2-7b (dev/decode_bench.py: GPUModel's sessions, depths, eager, host overhead, each GEMV),
# the bench verb's tg rows, a short table last. Logs and JSON under $OUT.
#   run(command="bash scripts/decode_check.sh", carry=[".whl", ".gpu_data"])
#   (or STEPS=decode bash scripts/gpu_check.sh). DECODE_STEPS="tests bench cli" selects parts.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/.gpu_out}"
mkdir -p "$OUT"
export GPU_REPORT="${GPU_REPORT:-$OUT/gpu_report.jsonl}"
if ! python3 -c "import gguf" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
STEPS="${DECODE_STEPS:-tests bench cli}"
M7="${DECODE_MODEL:-/tmp/l7b.gguf}"
rc=0
if [ ! -f "$M7" ]; then   # 15-30 s of CPU, overlapped with the tests
  python3 -m engine synth --shape llama2-7b --random-blocks "$M7" > "$OUT/decode_synth.log" 2>&1 &
  SYNTH=$!
fi
case " $STEPS " in *" tests "*)
  # two processes: a sticky CUDA error in the kernel checks cannot spoil the model checks
  for sel in "mmvq or attention or argmax or embed or rmsnorm or quantize_row or qkv_post" \
             "logits or greedy32 or session or sampler or greedy_never or step_launches"; do
    echo "--- decode tests: $sel"
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_gpu_decode.py -k "$sel" 2>&1 \
      | tee -a "$OUT/decode_tests.log" | grep -vE "^\s*$" | tail -25
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  done ;;
esac
[ -n "${SYNTH:-}" ] && { wait "$SYNTH" || { echo "synth failed"; cat "$OUT/decode_synth.log"; rc=1; }; }
case " $STEPS " in *" bench "*)
  echo "--- tg128 (dev/decode_bench.py over GPUModel sessions)"
  timeout 200 python3 -m dev.decode_bench --model "$M7" -n 128 -d "${DECODE_DEPTHS:-0,3314}" -r 5 \
    --eager --kernels --json "$OUT/decode_bench.json" 2>&1 \
    | tee "$OUT/decode_bench.log" | tr '\r' '\n' | grep -v "^loading"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1 ;;
esac
case " $STEPS " in *" cli "*)
  echo "--- gguf-prefill bench (GPUModel prefill + decode graph)"
  timeout 100 python3 -m engine bench --model "$M7" -p 512 -n 128 -d 0,3314 -r 3 --device gpu 2>&1 \
    | tee "$OUT/decode_cli_bench.log" | grep -v "loading"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1 ;;
esac
python3 scripts/decode_summary.py "$OUT" || rc=1
exit $rc
