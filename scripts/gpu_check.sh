#!/usr/bin/env bash
# One device call: install carried wheels, run the GPU tests, run the GEMM microbenchmark,
# print a short summary table last. Full logs and JSON go to $OUT (or ./.gpu_out).
#
#   device: run(command="bash scripts/gpu_check.sh", carry=[".whl", ".gpu_data"])
#   .whl: gguf, and fastapi/uvicorn/httpx with their dependencies (py3.12 wheels, for the GPU
#   server test): pip download gguf fastapi uvicorn httpx --only-binary=:all: \
#   --python-version 3.12 --platform manylinux2014_x86_64 -d .whl
#   GPU_TESTS="tests/test_a.py;tests/test_b.py -k x" splits the pytest run into processes.
#   GPU_REQUIRE=H200 runs nothing on a card whose name lacks it.
#   STEPS="tests bench" (default) selects sections (also: perf, sweep, ncu, prefill, decode, small, load,
#   llama, batched, splits, profile, ab, hopper, hopper_defs, hopper_pp, attn, synth, defines,
#   timeline, graph_timeline); add a section by writing a function
#   step_<name> below and naming it in STEPS (e.g. STEPS="tests bench model").
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/.gpu_out}"
mkdir -p "$OUT"
export GPU_REPORT="$OUT/gpu_report.jsonl"
: > "$GPU_REPORT"
rm -f "$OUT/test_groups.txt"
STEPS="${STEPS:-tests bench}"
STATUS=0

# GPU_REQUIRE=H200: run nothing unless the card's name contains it (a gate call that lands on
# another card then costs only its start; the device may give an H100 for an H200 request).
if [ -n "${GPU_REQUIRE:-}" ]; then
  gpu_name="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  case "$gpu_name" in
    *"$GPU_REQUIRE"*) ;;
    *) echo "GPU_REQUIRE=$GPU_REQUIRE: this card is '$gpu_name'; nothing run"; exit 0 ;;
  esac
fi

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}" \
      || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"

section() { echo; echo "=================== $* ($(date +%T))"; }

if [ "${LLAMA:-0}" = 1 ] && [ -f .gpu_data/llama.cpp.tar.gz ]; then
  setsid bash .gpu_data/build.sh "$PWD/.gpu_data/llama.cpp.tar.gz" > /tmp/llama_build_top.log 2>&1 &
  LLAMA_PID=$!
fi

step_env() {
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'nvrtc', cupy.cuda.nvrtc.getVersion())"
}

# GPU_TESTS: ';'-separated pytest argument lists, each run in its own process (a sticky CUDA
# error in one cannot spoil the others), each optionally led by NAME=VALUE words for its
# environment (e.g. "GGUF_PREFILL_KERNEL_DEFINES=AW_PROD=1 tests/test_gpu_model.py -k attention").
# Default: every gpu-marked test under tests/.
step_tests() {
  local rc=0 args
  IFS=';' read -ra groups <<< "${GPU_TESTS:-tests/}"
  for args in "${groups[@]}"; do
    echo "--- pytest -m gpu $args"
    local envs="" rest="$args"     # leading NAME=VALUE words: that group's environment
    while [[ "$rest" =~ ^[[:space:]]*([A-Z_][A-Z0-9_]*=[^[:space:]]*)[[:space:]]+(.*)$ ]]; do
      envs+="${BASH_REMATCH[1]} "; rest="${BASH_REMATCH[2]}"
    done
    eval "$envs timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -rfE $rest" 2>&1 | tee -a "$OUT/pytest_gpu.log"
    local status="${PIPESTATUS[0]}" verdict=pass
    [ "$status" -eq 0 ] || { rc=1; verdict=fail; }
    # the group's kernel defines and verdict, for step defines (dev/ab_bench --keep-tested)
    [[ "$envs" =~ GGUF_PREFILL_KERNEL_DEFINES=([^[:space:]]*) ]] && echo "$verdict ${BASH_REMATCH[1]}" >> "$OUT/test_groups.txt"
  done
  return $rc
}

step_bench() {
  python3 -m dev.gemm_bench --json "$OUT/gemm_bench.json" 2>&1 | tee "$OUT/gemm_bench.log"
  local rc="${PIPESTATUS[0]}"
  step_sweep || rc=1
  return "$rc"
}

# the production variant choice (gpu_ops.choose_variant) across token counts
step_sweep() {
  python3 -m dev.gemm_bench --shapes sweep --variants default --tokens 1,64,65,256,512,1024,3314,8192 \
      --reps 10 --json "$OUT/gemm_sweep.json" 2>&1 | tee -a "$OUT/gemm_bench.log"
  return "${PIPESTATUS[0]}"
}

# Small batches (issue 12): every small-batch candidate (gemm_bench --variants small) at
# T = 1..128 on the 7B shapes, then the bench verb's pp1..pp128 rows with the per-op breakdown
# (SMALL_PP=none: the GEMM rows only).
step_small() {
  python3 -m dev.gemm_bench --variants "${SMALL_VARIANTS:-small}" --tokens "${SMALL_TOKENS:-1,8,16,32,64,128}" --reps 10 \
      --shapes "${SMALL_SHAPES:-7b}" --json "$OUT/gemm_small.json" > "$OUT/gemm_small.log" 2>&1
  local rc=$?
  python3 -m dev.gemm_pick "$OUT/gemm_small.json" || rc=1
  [ "${SMALL_PP:-}" = none ] && return $rc     # the GEMM rows only
  local m=/tmp/llama2-7b.gguf
  synth_wait llama2-7b || return 1
  timeout 300 python3 -m engine bench --model "$m" --device gpu -p "${SMALL_PP:-1,8,32,64,128}" -r 5 --breakdown \
      > "$OUT/bench_small.txt" 2> "$OUT/bench_small.err" || rc=1
  tr '\r' '\n' < "$OUT/bench_small.err" | grep -v '^$' | tail -5
  cat "$OUT/bench_small.txt" | head -80
  return $rc
}

# Nsight Compute stall profile of the GEMM kernels (NCU_ARGS: ';'-separated "T N K [VARIANT]" for
# ncu_mmq.py; each profiles the second launch of the q4_K and the q6_K kernel; NCU_SOURCE=1 also
# writes ncu_src_<i>.csv, the q4_K kernel's stall samples per SASS instruction, and prints
# dev/ncu_src_summary's ranking of it: NCU_SRC_TOP instructions, per opcode). NCU_KERNELS /
# NCU_SRC_KERNEL: the kernel-name regexes (e.g. wgmma_q / wgmma_q4 with VARIANT wgmma).
# NCU_EXTRA: more ncu arguments (e.g. "--section MemoryWorkloadAnalysis_Tables" for the L1 / LSU
# per SM; the lines this step greps out of the report stay the same, the whole report is ncu_<i>.txt).
step_ncu() {
  local ncu rc=0 args i=0; ncu="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
  [ -n "$ncu" ] || { echo "ncu not found"; return 1; }
  IFS=';' read -ra runs <<< "${NCU_ARGS:-3314 11008 4096}"
  for args in "${runs[@]}"; do
    i=$((i + 1))
    "$ncu" --clock-control none --kernel-name regex:"${NCU_KERNELS:-mm(q|sb|vq)_q}" --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        --section ComputeWorkloadAnalysis --section Occupancy --section MemoryWorkloadAnalysis \
        --section LaunchStats --section InstructionStats ${NCU_EXTRA:-} \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        python3 -m dev.ncu_mmq $args > "$OUT/ncu_$i.txt" 2>&1 || rc=1
    echo "--- ncu $args"
    if [ -n "${NCU_SOURCE:-}" ]; then   # per-SASS-instruction stall samples of the q4_K kernel
      "$ncu" --clock-control none --kernel-name regex:"${NCU_SRC_KERNEL:-mm(q|sb)_q4}" --launch-skip 1 --launch-count 1 \
          --section SourceCounters -f -o "/tmp/ncu_src_$i" python3 -m dev.ncu_mmq $args > /dev/null 2>&1 &&
      "$ncu" -i "/tmp/ncu_src_$i.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_src_$i.csv" 2>&1 || rc=1
      python3 -m dev.ncu_src_summary "$OUT/ncu_src_$i.csv" --top "${NCU_SRC_TOP:-25}" || rc=1
    fi
    grep -E "mm(q|sb|vq)_q|wgmma_q|stalled_(long|short|barrier|wait|math|mio|lg|not_sel|selected|dispatch|drain|imc|no_inst|branch|membar|sleep|tex)|Duration|DRAM Throughput|Memory Throughput|Warp Cycles Per Issued|Issued Ipc|Achieved Occupancy|Registers Per|Eligible Warps|Waves Per SM|Block Limit" "$OUT/ncu_$i.txt" | cut -c1-130 | head -80
  done
  return $rc
}

# The whole-model speed rows (bench verb) on a synthetic llama2-7b q4_K_M made on the device:
# pp1..pp128 (short prompts: the prefill graph), pp512, pp3314 (prefill) and tg128 (CUDA-graph
# decode), medians of PERF_REPS.
step_perf() {
  local m=/tmp/llama2-7b.gguf
  synth_wait llama2-7b || return 1
  timeout 420 python3 -m engine bench --model "$m" --device gpu -p "${PERF_PP:-1,8,16,32,64,128,512,3314}" -n 128 -r "${PERF_REPS:-5}" \
      --json > "$OUT/perf.json" 2> "$OUT/perf.err"
  local rc=$?
  tr '\r' '\n' < "$OUT/perf.err" | grep -v '^$' | grep -v "^loading" | tail -3
  python3 -c "import json, sys; [print(f\"{r['test']}: median {r['median_ts']:.1f} tok/s\") for r in json.load(open(sys.argv[1]))['rows']]" "$OUT/perf.json"
  return $rc
}

# Many users (issue 13): `serve --device gpu` on the synthetic llama2-7b with --parallel LOAD_NP,
# scripts/load_gen.py at LOAD_CONC (256-token random prompts, 128 tokens each, ignore_eos), then the
# shared-prefix probe (two requests with the same 2,000-token prefix, one after the other) and the
# server's batching metrics (step_llama puts llama.cpp's batched rows beside them).
step_load() {
  local m=/tmp/llama2-7b.gguf port=8093 rc=0 i
  synth_wait llama2-7b || return 1
  python3 -m engine serve -m "$m" --device gpu --host 127.0.0.1 --port $port --parallel "${LOAD_NP:-32}" \
      --max-queue 512 ${LOAD_ARGS:-} > "$OUT/serve.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 300); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null && break
    kill -0 $pid 2>/dev/null || { tail -20 "$OUT/serve.log"; return 1; }
    sleep 1
  done
  echo "server ready after ${i}s"
  timeout 300 python3 scripts/load_gen.py --port $port --concurrency "${LOAD_CONC:-1,8,32}" --prompt-tokens 256 \
      --max-tokens 128 --id-lo 100 --id-hi 31000 --json "$OUT/load.json" 2>&1 | tail -12 || rc=1
  timeout 120 python3 scripts/load_gen.py --port $port --concurrency 1 --requests 2 --warmup 0 --prompt-tokens 2048 \
      --shared-prefix 2000 --max-tokens 4 --id-lo 100 --id-hi 31000 --seed 7 --json "$OUT/prefix.json" 2>&1 | tail -3 || rc=1
  python3 - "$OUT/prefix.json" <<'PY' || rc=1
import json, sys
t = json.load(open(sys.argv[1]))["records"][0]["ttfts_s"]
print(f"prefix probe: TTFT first {t[0]:.3f} s, second {t[1]:.3f} s, ratio {t[1] / t[0]:.3f} (gate <= 0.20)")
PY
  python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$port/metrics').read().decode())" \
      | grep -E "^gguf_prefill_(batch_(tokens|sequences)_(sum|count)|step_seconds_(sum|count)|prefix_cache|time_to_first_token_seconds_(sum|count)|generated_tokens_total)" 
  kill -TERM $pid; wait $pid
  grep -E "Traceback|ERROR" "$OUT/serve.log" | head -5
  return $rc
}

# llama.cpp on the same synthetic model, same call (build it with LLAMA=1 at the top of this or
# an earlier call of the same warm lease): llama-batched-bench (npp 256, ntg 128, npl 1,8,32: the
# rows of `bench --batched`) and llama-bench (LLAMA_PP, tg128).
step_llama() {
  local m=/tmp/llama2-7b.gguf rc=0 bin=/tmp/llama.cpp/build/bin
  synth_wait llama2-7b || return 1
  [ -x $bin/llama-batched-bench ] || wait_llama || return 1
  timeout 200 $bin/llama-batched-bench -m "$m" -ngl 99 -fa on -c 16384 -b 2048 -ub 512 \
      -npp 256 -ntg 128 -npl 1,8,32 > "$OUT/llama_batched.txt" 2>&1 || rc=1
  grep -E "^\|" "$OUT/llama_batched.txt" | tail -5
  timeout 200 $bin/llama-bench -m "$m" -p "${LLAMA_PP:-32,128,512}" -n 128 -fa 1 -r 3 -ngl 99 \
      > "$OUT/llama_bench.txt" 2>&1 || rc=1
  grep -E "^\|" "$OUT/llama_bench.txt" | tail -6
  return $rc
}

# Many users without HTTP (issue 13): `bench --batched` (llama-batched-bench's rows through the
# scheduler: npl sequences of 256 prompt tokens, 128 generated each), with a per-op breakdown of
# the decode-only step at each npl.
step_batched() {
  local m=/tmp/llama2-7b.gguf
  synth_wait llama2-7b || return 1
  timeout 300 python3 -m engine bench --model "$m" --device gpu --batched "${BATCHED_NPL:-1,8,32}" --npp 256 \
      --ntg 128 -r "${BATCHED_REPS:-3}" ${BATCHED_ARGS:---breakdown} > "$OUT/batched.txt" 2> "$OUT/batched.err"
  local rc=$?
  tr '\r' '\n' < "$OUT/batched.err" | grep -v '^$' | tail -4
  cat "$OUT/batched.txt"
  return $rc
}

# Hopper f16 GEMM (issue 14): wgmma_q4_k beside the production MMQ and cuBLAS f16 (dev/hopper_bench).
step_hopper() {
  python3 -m dev.hopper_bench --tokens "${HOPPER_TOKENS:-512,3314}" --configs "${HOPPER_CONFIGS:-auto,128x4,256x4}" \
      ${HOPPER_SHAPES:+--shapes $HOPPER_SHAPES} --json "$OUT/hopper.json" 2>&1 | tee "$OUT/hopper.log"
  return "${PIPESTATUS[0]}"
}

# Compile-time variants of the Hopper GEMMs side by side: HOPPER_DEFS, ';'-separated
# GGUF_PREFILL_KERNEL_DEFINES values ("" = the default), each through hopper_bench --wgmma-only in
# its own process (HOPPER_TOKENS, HOPPER_CONFIGS default auto, HOPPER_SHAPES); per variant and T
# the summed time over the shapes, and whether every output was within the bound.
step_hopper_defs() {
  local rc=0 i=0 d defs
  IFS=';' read -ra defs <<< "${HOPPER_DEFS:-;}"   # unset or empty: the default build alone
  for d in "${defs[@]}"; do
    GGUF_PREFILL_KERNEL_DEFINES="$d" python3 -m dev.hopper_bench --wgmma-only --tokens "${HOPPER_TOKENS:-32,64,128}" \
        --configs "${HOPPER_CONFIGS:-auto}" ${HOPPER_SHAPES:+--shapes $HOPPER_SHAPES} --reps "${HOPPER_REPS:-20}" \
        --json "$OUT/hopper_def$i.json" > "$OUT/hopper_def$i.log" 2>&1 || rc=1
    python3 - "$OUT/hopper_def$i.json" "${d:-(default)}" <<'PY' || rc=1
import collections, json, sys
rows = json.load(open(sys.argv[1]))
tot, ok = collections.defaultdict(float), all(r["ok"] for r in rows)
for r in rows:
    tot[(r["T"], r["config"])] += r["wgmma_ms"] * 1000
print(f"{sys.argv[2]:>50s}: " + "  ".join(f"T={t} {c} {v:7.1f} us" for (t, c), v in sorted(tot.items())) + f"  ok={ok}")
PY
    i=$((i + 1))
  done
  return $rc
}

# Where a wgmma GEMM's time goes block by block (dev/wg_timeline: the WG_TIMELINE build's phase
# stamps of the last of back-to-back launches): TIMELINE_SHAPES, TIMELINE_TOKENS (32),
# TIMELINE_CONFIGS (auto), TIMELINE_SWIGLU=1 for the gate|up kernel with SwiGLU fused.
step_timeline() {
  python3 -m dev.wg_timeline --shapes "${TIMELINE_SHAPES:-q4_k:22016x4096,q4_k:4096x4096,q6_k:4096x11008}" \
      --tokens "${TIMELINE_TOKENS:-32}" --configs "${TIMELINE_CONFIGS:-auto}" \
      ${TIMELINE_SWIGLU:+--swiglu} --json "$OUT/timeline${TIMELINE_SWIGLU:+_swiglu}.json" 2>&1 | tee "$OUT/timeline${TIMELINE_SWIGLU:+_swiglu}.log"
  return "${PIPESTATUS[0]}"
}

# Prefill attention kernels side by side (issue 14): dev/attn_bench on the 7B head layouts at long
# context (ATTN_VARIANTS, default every variant; ATTN_CASES, ATTN_HEADS), TFLOP/s and the largest
# difference from the first variant's output.
step_attn() {    # under a timeout: a hung kernel must not eat the call (Session 18)
  timeout "${ATTN_TIMEOUT:-120}" python3 -m dev.attn_bench --reps "${ATTN_REPS:-5}" ${ATTN_VARIANTS:+--variants $ATTN_VARIANTS} \
      ${ATTN_CASES:+--cases $ATTN_CASES} ${ATTN_HEADS:+--heads $ATTN_HEADS} --json "$OUT/attn.json" 2>&1 | tee "$OUT/attn.log"
  return "${PIPESTATUS[0]}"
}

# Synthetic models made in the background (SYNTH_SHAPES; step synth at the top of STEPS lets
# them build during the tests), /tmp/<shape>.gguf; synth_wait makes or waits for one.
synth_make() {
  timeout 400 python3 -m engine synth --shape "$1" --random-blocks "/tmp/$1.gguf" > /dev/null 2>&1 && touch "/tmp/$1.done"
}
step_synth() {
  local shape
  for shape in ${SYNTH_SHAPES:-${DEFINE_SHAPES:-llama2-7b}}; do
    [ -f "/tmp/$shape.started" ] && continue
    touch "/tmp/$shape.started"
    synth_make "$shape" &
  done
  return 0
}
synth_wait() {
  local i
  if [ ! -f "/tmp/$1.started" ]; then
    touch "/tmp/$1.started"
    synth_make "$1"
  fi
  for i in $(seq 1 200); do [ -f "/tmp/$1.done" ] && return 0; sleep 2; done
  return 1
}

# Kernel define sets side by side in one process each (DEFINE_SETS: ';'-separated
# GGUF_PREFILL_KERNEL_DEFINES sets, an empty entry = production, the first the baseline):
# dev/attn_bench on the attention cases, then dev/ab_bench's bench rows (DEFINE_PP, DEFINE_TG)
# on each synthetic shape of DEFINE_SHAPES (one process), rounds interleaved, with the pp8192 /
# pp3314 quotient. Sets that a failed GPU_TESTS group covers are left out (kept_sets).
step_defines() {
  local shape m rc=0 DEFINE_SETS="${DEFINE_SETS:-}"
  if [ -f "$OUT/test_groups.txt" ]; then      # a form whose GPU tests failed or hung is not timed
    DEFINE_SETS="$(python3 -m dev.ab_bench --keep-tested "$OUT/test_groups.txt" --sets "$DEFINE_SETS")" || return 1
  fi
  [ "${DEFINE_ATTN:-1}" = 0 ] ||                # DEFINE_ATTN=0: no attention rows (GEMM-only defines)
  timeout "${ATTN_TIMEOUT:-150}" python3 -m dev.attn_bench --reps "${ATTN_REPS:-5}" --variants wgmma \
      --cases "${ATTN_CASES:-4096@4096,3314@0,4096@0}" --heads "${ATTN_HEADS:-32/32,28/4}" \
      --defines "${DEFINE_SETS:-}" --json "$OUT/attn_defines.json" 2>&1 | tee "$OUT/attn_defines.log" || rc=1
  local models=""
  for shape in ${DEFINE_SHAPES:-llama2-7b}; do
    synth_wait "$shape" || return 1
    models+="${models:+,}/tmp/$shape.gguf"
  done
  timeout "${DEFINE_TIMEOUT:-400}" python3 -m dev.ab_bench --model "$models" --sets "${DEFINE_SETS:-}" \
      -p "${DEFINE_PP:-3314,8192}" -n "${DEFINE_TG:-0}" -r "${DEFINE_REPS:-3}" --rounds "${DEFINE_ROUNDS:-2}" \
      --json "$OUT/ab_defines.json" 2>&1 | grep -v "^loading" | tee "$OUT/ab_defines.log" || rc=1
  return $rc
}

# The Hopper route in the whole model (issue 14): `bench` on synthetic models (HOPPER_PP_SHAPES,
# default llama2-7b; HOPPER_PP token counts, HOPPER_PP_REST those of the shapes after the first) with the GEMMs on MMQ (GGUF_PREFILL_WGMMA=0) and on wgmma, same call, with the
# per-op breakdown (HOPPER_PP_MODES="1": the wgmma route alone).
step_hopper_pp() {
  local shape m rc=0 mode pp="${HOPPER_PP:-512,3314}"
  for shape in ${HOPPER_PP_SHAPES:-llama2-7b}; do
    m=/tmp/$shape.gguf
    synth_wait "$shape" || return 1
    for mode in ${HOPPER_PP_MODES:-0 1}; do
      GGUF_PREFILL_WGMMA=$mode timeout 300 python3 -m engine bench --model "$m" --device gpu -p "$pp" \
          -r "${HOPPER_REPS:-5}" --breakdown --json > "$OUT/hopper_pp_${shape}_$mode.json" 2> "$OUT/hopper_pp_${shape}_$mode.err" || rc=1
      echo "--- $shape GGUF_PREFILL_WGMMA=$mode"
      tr '\r' '\n' < "$OUT/hopper_pp_${shape}_$mode.err" | grep -v '^$' | grep -v "^loading" | tail -"${HOPPER_LINES:-30}"
    done
    pp="${HOPPER_PP_REST:-$pp}"              # token counts for the shapes after the first
  done
  return $rc
}

# Small-batch MMQ grids: the production plan against every tile split into P K-parts
# (dev/split_sweep.py) on the 7B shapes.
step_splits() {
  python3 -m dev.split_sweep --tokens "${SPLIT_TOKENS:-16,32,64}" --json "$OUT/split_sweep.json" 2>&1 | tee "$OUT/split_sweep.log"
  return "${PIPESTATUS[0]}"
}

# Each kernel's share of a graph as it runs (dev/graph_timeline, the KERNEL_TIMELINE build): for
# each synthetic shape of GT_SHAPES (llama2-7b) the pp GT_TOKENS (32) forward graph and the decode
# step at depth GT_DEPTH (256), GT_REPLAYS (20) back-to-back replays each; GT_MODES (pp tg).
step_graph_timeline() {
  local shape mode rc=0
  for shape in ${GT_SHAPES:-llama2-7b}; do
    synth_wait "$shape" || { echo "synth $shape failed"; rc=1; continue; }
    for mode in ${GT_MODES:-pp tg}; do
      timeout 300 python3 -m dev.graph_timeline "/tmp/$shape.gguf" --mode "$mode" --tokens "${GT_TOKENS:-32}" \
          --depth "${GT_DEPTH:-256}" --replays "${GT_REPLAYS:-20}" --json "$OUT/graph_tl_${shape}_$mode.json" \
          2>&1 | grep -v "^loading" | tail -30 || rc=1
    done
  done
  return $rc
}

# Kernel time of a batched decode step (PROFILE_NPL slots at depth PROFILE_DEPTH (256),
# PROFILE_STEPS graph replays (1) after two warm-up steps; PROFILE_NPL=1: the single-stream decode
# graph; PROFILE_NPL=0: prompt forwards of PROFILE_DEPTH tokens) from Nsight Compute: each kernel
# node's duration (no event overhead; kernels serialized, caches not flushed), summed per kernel
# family by scripts/kern_summary.py.
step_profile() {
  local m=/tmp/llama2-7b.gguf ncu npl
  synth_wait llama2-7b || return 1
  ncu="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
  [ -n "$ncu" ] || { echo "ncu not found"; return 1; }
  for npl in ${PROFILE_NPL:-32}; do
    for bps in ${PROFILE_BPS:-0}; do        # PROFILE_BPS: decode-attention blocks per SM to try
      [ "$bps" = 0 ] && bps=""              # 0: the production value
      timeout 300 "$ncu" --profile-from-start off --graph-profiling node --cache-control none --clock-control none \
          --metrics gpu__time_duration.sum --csv --print-units base \
          python3 -m dev.step_profile "$m" "$npl" "${PROFILE_DEPTH:-256}" "${PROFILE_STEPS:-1}" $bps > "$OUT/kern_$npl$bps.csv" 2> "$OUT/profile_$npl.err" \
          || { tail -5 "$OUT/profile_$npl.err"; tail -3 "$OUT/kern_$npl$bps.csv"; return 1; }
      python3 scripts/kern_summary.py "$OUT/kern_$npl$bps.csv" "${PROFILE_STEPS:-1}" "x$npl ${bps:+blocks/SM $bps}" | head -${PROFILE_LINES:-14}
    done
  done
}

# Same-call A/B: AB_STEPS (default "perf") run once per environment of AB_SETS (';'-separated
# sets of VAR=value assignments, default "GGUF_PREFILL_PDL=0;GGUF_PREFILL_PDL=1"), the sets
# alternating AB_ROUNDS times; each run's files go to /tmp/ab/<set index>_<round> (not brought back).
step_ab() {
  local out0="$OUT" rc=0 r i s sets
  IFS=';' read -ra sets <<< "${AB_SETS:-GGUF_PREFILL_PDL=0;GGUF_PREFILL_PDL=1}"
  for r in $(seq 1 "${AB_ROUNDS:-1}"); do
    for i in "${!sets[@]}"; do
      for s in ${AB_STEPS:-perf}; do
        echo "--- round $r: $s with ${sets[$i]}"
        OUT="/tmp/ab/${i}_$r"; mkdir -p "$OUT"
        ( export ${sets[$i]}; "step_$s" ) || rc=1
      done
    done
  done
  OUT="$out0"
  return $rc
}

# llama.cpp, built in the background at the top of the call (LLAMA=1): wait for it (bounded).
wait_llama() {
  [ -n "${LLAMA_PID:-}" ] || return 1
  local i
  for i in $(seq 1 ${LLAMA_WAIT:-240}); do kill -0 "$LLAMA_PID" 2>/dev/null || break; sleep 1; done
  [ -x /tmp/llama.cpp/build/bin/llama-batched-bench ] || { echo "llama.cpp not built"; tail -5 /tmp/llama_build.log 2>/dev/null; return 1; }
}

# GPU prefill (issue 4): kernels, whole-model logits vs the reference, bench (carry .gpu_data).
step_prefill() {
  bash scripts/prefill_check.sh
}

# GPU decode (issue 7): decode tests, tg128 bench, bench verb tg rows (carry .gpu_data).
step_decode() {
  bash scripts/decode_check.sh
}

for s in env $STEPS; do
  section "$s"
  "step_$s" || { echo "!! step $s failed (rc $?)"; STATUS=1; }
done

if [ -n "${LLAMA_PID:-}" ]; then section "llama.cpp build"; wait_llama && echo "llama.cpp built"; fi

section summary
python3 scripts/gpu_summary.py "$OUT" || STATUS=1
[ -f "$OUT/pytest_gpu.log" ] && grep -E "^[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s" "$OUT/pytest_gpu.log"
[ -f "$OUT/perf.err" ] && grep -E "^(pp|tg)[0-9]+:" "$OUT/perf.err" | tail -12
exit $STATUS
