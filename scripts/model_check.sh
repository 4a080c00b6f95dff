#!/usr/bin/env bash
# The whole default model on the GPU (issue 11), in the last call of a lease whose earlier calls
# carried its 22 part files one by one into $PARTS (see "carry" below):
#   1. reassemble the GGUF from $PARTS/part01.bin .. part22.bin and check its sha256;
#   2. greedy32 --device gpu against tests/goldens/llamacpp (teacher-forced and free run, margin 0.5);
#   3. serve --device gpu answers a completion, with the tokens of generate --device gpu;
#   4. bench -p 512,3314 -n 128.
# A short table is printed last.
#
#   carry, one call each (machine kept warm):  run(command="mkdir -p /root/parts && mv .gpu_parts/partNN.bin /root/parts/",
#                                                  carry=[".gpu_parts/partNN.bin"])
#   then:                                      run(command="bash scripts/model_check.sh", carry=[".whl"])
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/.gpu_out}"
PARTS="${PARTS:-/root/parts}"
MODEL="${MODEL:-/root/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}"
WANT_SHA=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
GOLDEN=tests/goldens/llamacpp/qwen2.5-coder-1.5b-q4_k_m.json
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}" \
      || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
declare -A RES
section() { echo; echo "=================== $* ($(date +%T))"; }

section assemble
n=$(ls "$PARTS"/part*.bin 2>/dev/null | wc -l)
if [ ! -f "$MODEL" ]; then
  [ "$n" -eq 22 ] || { echo "only $n of 22 parts in $PARTS"; exit 1; }
  cat "$PARTS"/part{01..22}.bin > "$MODEL"
fi
sha=$(sha256sum "$MODEL" | cut -d' ' -f1)
echo "$(stat -c %s "$MODEL") bytes, sha256 $sha"
[ "$sha" = "$WANT_SHA" ] && RES[sha256]=ok || { RES[sha256]="MISMATCH"; echo "sha256 mismatch"; exit 1; }

section greedy32
for mode in "--teacher-forced" ""; do
  name="greedy32${mode:+ teacher-forced}"
  timeout 300 python3 -m engine greedy32 --device gpu -m "$MODEL" --golden "$GOLDEN" --min-margin 0.5 $mode 2>&1 \
      | tee -a "$OUT/greedy32.log" | tail -12
  [ "${PIPESTATUS[0]}" -eq 0 ] && RES[$name]=pass || RES[$name]=FAIL
done

section serve
PROMPT='def fibonacci(n):'
timeout 120 python3 -m engine generate --device gpu -m "$MODEL" --prompt "$PROMPT" -n 24 --json 2>/dev/null | tail -1 > "$OUT/generate.json"
python3 -m engine serve --device gpu -m "$MODEL" --host 127.0.0.1 --port 18080 > "$OUT/serve.log" 2>&1 &
spid=$!
for _ in $(seq 240); do
  curl -sf http://127.0.0.1:18080/health >/dev/null 2>&1 && break
  kill -0 $spid 2>/dev/null || break
  sleep 0.5
done
curl -s http://127.0.0.1:18080/v1/completions -H 'content-type: application/json' \
    -d "{\"prompt\": \"$PROMPT\", \"max_tokens\": 24}" > "$OUT/completion.json"
kill -TERM $spid; wait $spid
python3 - "$OUT" <<'PY' && RES[serve]=pass || RES[serve]=FAIL
import json, sys
out = sys.argv[1]
gen = json.load(open(f"{out}/generate.json"))
comp = json.load(open(f"{out}/completion.json"))
text = comp["choices"][0]["text"]
print("generate:", repr(gen["text"]))
print("serve:   ", repr(text), comp.get("usage"))
sys.exit(0 if text == gen["text"] and comp["usage"]["completion_tokens"] == len(gen["tokens"]) else 1)
PY
tail -5 "$OUT/serve.log"

section bench
timeout 400 python3 -m engine bench --device gpu -m "$MODEL" -p 512,3314 -n 128 -r 5 2>&1 | tee "$OUT/bench.log" | tail -12
[ "${PIPESTATUS[0]}" -eq 0 ] && RES[bench]=ok || RES[bench]=FAIL

section summary
for k in sha256 "greedy32 teacher-forced" greedy32 serve bench; do printf '%-26s %s\n' "$k" "${RES[$k]:-not run}"; done
grep -E "pp512|pp3314|tg128" "$OUT/bench.log" | tail -3
