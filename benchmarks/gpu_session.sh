#!/usr/bin/env bash
# One device call: every GPU test, then the GPU benchmarks, each bounded in time, full output under $OUT.
#   BENCH_GIT_COMMIT=<commit> bash benchmarks/gpu_session.sh [tests] [quant] [sparse] [sparse-tests] [exact]
#   sparse: SPARSE_PREDICTOR=previous|none|query|cache picks the predictor, SPARSE_ARGS adds bench_sparse.py flags
#   sparse-runs: bench_sparse.py once per entry of SPARSE_RUNS (predictor:cache selections:prefetch margin, default
#   "cache:3:32 cache:4:32 none:1:0"), each on the bias-16 model (SPARSE_BIAS, default 16), its decode steps in turn
#   with DynamicCache's and a preallocated StaticCache's; SPARSE_ARGS adds flags to every run
#   exact: TRANSFER_BACKENDS="auto memcpy_batch" adds rows per transfer backend; sweep: SWEEP_ARGS=--contended
#   far-sparse: the hot window's sparse far path alone, eager and with CUDA graphs (no vLLM needed; FAR_ROWS="1 4 10"
#   sets the row counts);
#   graph-tests: the GPU tests of those graphs, of the far-block caches, the bound kernel, the rows attention and
#   the block-completing step's save (it must not wait for the device), and the planted needles at the 8B shape
#   (the far path eager and graphed, the transformers engine);
#   bounds: the key bound kernel alone, per launch shape (bench_bounds.py: 1 and 10 rows of 2048 blocks)
#   save-step: the host time of the step that completes blocks (bench_save_step.py: 10 requests x 32 layers saved
#   layer by layer against all at once, 200 ms of device work queued before each save, as in the engine: a save
#   that waits for the device shows it; SAVE_DTYPE the CPU tier's storage dtype, default float8_e4m3fn)
# vLLM steps, after the bundle's second staged call has sourced .vb/on-device.sh (../shared/device/vllm):
#   vllm-model8b (builds MODEL_DIR, default /tmp/m8; needs no vLLM, so it fits the first staged call), vllm-check
#   (8-layer model: plain vs hot window, tokens and logprobs), vllm-plain, vllm-tierkv, vllm-sparse,
#   vllm-sparse-graphs (sparse decode rows replayed from CUDA graphs), vllm-sparse-check (its whole
#   graphs against the split path, numerically: CHECK_WHOLE_GRAPHS layer calls, default 64),
#   vllm-offloading (bench_vllm rows at 128k, one engine per process; PROFILE_STEPS="8 9 20 21" profiles
#   those engine steps; VLLM_ARGS adds bench_vllm.py flags, e.g. "--tp 2" on two GPUs, "--profile-prefix" for a profiled
#   repeated-prefix step, "--storage-dtype float8_e4m3fn" for an fp8 CPU tier, "--compiled" for
#   vLLM's compiled CUDA-graph mode, rows MODE@compiled against plain@compiled), vllm-lmcache
#   (LMCache's connector: its bundle installed and LMCACHE_* set first), vllm-table; vllm-batch-plain,
#   vllm-batch-sparse, vllm-batch-sparse-graphs, vllm-batch-sparse-graphs-fp8, vllm-batch-table
#   (bench_vllm_batch.py: the largest batch of 128k requests at a fixed GPU memory for KV and its decode
#   tokens/s; the fp8 step stores the CPU tier in float8, FP8_REQUESTS requests, BATCH_MODE its mode, e.g.
#   tierkv-sparse-full with BATCH_ARGS=--compiled; BATCH_ARGS adds flags, e.g.
#   "--profile-after 20" profiles the step after 20 full-batch steps)
# vllm-batch-ab: the batch's plain (compiled) and BATCH_MODE rows alternating, REPEATS pairs (-r1, -r2, ...), each
#   against the plain row of its pair; BATCH_ARGS as above (default --compiled); REPEAT_FROM=2 REPEATS=2 runs pair
#   r2 alone (a pair takes about 270 s: two fit no device call beside vLLM's install)
# vllm-ab: plain and tierkv-sparse-graphs alternating, REPEATS pairs, each sparse row against its neighbour
#   (SPARSE_MODE=tierkv-sparse-full with VLLM_ARGS=--compiled: the sparse step inside vLLM's full decode graph)
#   (STORAGE_DTYPE=int8 or float8_e4m3fn for the sparse rows' CPU tier; VLLM_ARGS as above; SPARSE_VLLM_ARGS
#   adds bench_vllm flags to the sparse rows only, e.g. --async-scheduling)
# vllm-compiled-quant: plain --compiled, then tierkv-sparse-graphs --compiled over int8 and fp8 CPU tiers, REPEATS
#   (default 2) runs each as rows MODE-r1, MODE-r2 (bench_vllm --tag); VLLM_ARGS as above
# PIN_CORES="2-5" runs the bench_vllm engines on those cores only (taskset).
# More than 8 files under $OUT come back as one results.tar.gz (PACK_OUT=0: left as they are).
# VLLM_ARGS="--sample-h2d 16" samples the H2D bandwidth every 16 engine steps (is PCIe contended when
# sparse steps slow down?); CHECK_WHOLE_GRAPHS=N compares the first N whole-graph layer calls with the
# split path (bench_vllm's table prints the largest difference)
set -uo pipefail
OUT="${OUT:-/tmp/tierkv-gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests quant sparse exact)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
# the GPU's PCIe and NUMA placement, for reading copy-bound rows across leases
{ nvidia-smi topo -m; lscpu | grep -i -E "numa|model name|^cpu\(s\)"; } > "$OUT/topology.txt" 2>&1 || true
summary=()
# MODEL_DIR: the model the vLLM steps run (vllm-model8b builds it; QK_BIAS_STD=16 gives its queries a direction
# stable across steps, bench_vllm.build_model); BV_NAME: the folder under $OUT their rows go to
M8="${MODEL_DIR:-/tmp/m8}"
BV="$OUT/${BV_NAME:-bv}"
# PIN_CORES="2-5": the bench_vllm engines run on those cores only (taskset): does a slow engine process
# follow the cores it runs on? (bench_vllm records the core and a host speed probe per row)
PIN=""
if [ -n "${PIN_CORES:-}" ]; then
    if command -v taskset > /dev/null; then PIN="taskset -c $PIN_CORES"; else echo "PIN_CORES: no taskset here; not pinned" >&2; fi
fi
quiet() { grep -v "^INFO\|^WARNING\|^(EngineCore\|^DEBUG\|^\[rank" || true; }
for step in "${steps[@]}"; do
    start=$(date +%s)
    case "$step" in
        tests)  timeout 300 python3 -m pytest -m gpu tests -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/gpu-tests.log" | tail -30 ;;
        quant-tests) timeout 200 python3 -m pytest -m gpu tests/gpu/test_quant_gpu.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests-quant.log" | tail -15 ;;
        quant)  timeout 240 python3 benchmarks/bench_quant.py --out "$OUT/quant-h200.json" 2>&1 | tee "$OUT/quant.log" ;;
        far-sparse) timeout 200 python3 benchmarks/bench_far_sparse.py --far-tokens 126976 --layers 4 --rows ${FAR_ROWS:-1 4} --graphs --out "$OUT/far-sparse-h200.json" 2>&1 | tail -8 ;;
        save-step) timeout 120 python3 benchmarks/bench_save_step.py --storage-dtype ${SAVE_DTYPE:-float8_e4m3fn} --gpu-busy-ms 200 \
            --out "$OUT/save-step-h200.json" 2>&1 | tail -4 ;;
        bounds) timeout 120 python3 benchmarks/bench_bounds.py --rows 1 10 --out "$OUT/bounds-h200.json" 2>&1 | tail -32 ;;
        sparse) timeout 240 python3 benchmarks/bench_sparse.py --predictor ${SPARSE_PREDICTOR:-previous} ${SPARSE_ARGS:-} --out "$OUT/sparse-${SPARSE_PREDICTOR:-previous}-h200.json" 2>&1 | tee "$OUT/sparse-${SPARSE_PREDICTOR:-previous}.log" ;;
        sparse-runs)
            for entry in ${SPARSE_RUNS:-cache:3:32 cache:4:32 none:1:0}; do
                IFS=: read -r predictor selections margin <<< "$entry"
                extra=""; [ "$predictor" = cache ] && extra="--cache-selections $selections --prefetch-margin $margin"
                name="sparse-$predictor-s$selections-m$margin"
                timeout 200 python3 benchmarks/bench_sparse.py --predictor "$predictor" --qk-bias-std "${SPARSE_BIAS:-16}" \
                    $extra ${SPARSE_ARGS:-} --out "$OUT/$name-h200.json" > "$OUT/$name.log" 2>&1
                echo "== $entry"; tail -6 "$OUT/$name.log"
            done ;;
        graph-tests) timeout 330 python3 -m pytest -m gpu tests/gpu/test_far_graphs_gpu.py tests/gpu/test_decode_graph_gpu.py tests/vllm/test_far_cache.py \
            tests/gpu/test_save_gpu.py tests/gpu/test_planted_needle_gpu.py tests/sparse/test_bounds_kernel.py tests/attention/test_triton.py::test_gpu_rows_of_ten_decoding_requests -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/gpu-tests-graphs.log" | tail -15 ;;
        sparse-tests) timeout 200 python3 -m pytest -m gpu tests/gpu/test_sparse_query_gpu.py -q -s -p no:cacheprovider -rs 2>&1 | tee "$OUT/gpu-tests-sparse.log" | tail -15 ;;
        exact)  timeout 300 python3 benchmarks/bench_exact.py --contexts 131072 --new-tokens 6 --no-offloaded --prefill-chunks ${PREFILL_CHUNKS:-32768} --transfer-backends ${TRANSFER_BACKENDS:-auto} --out "$OUT/exact-128k-h200.json" 2>&1 | tee "$OUT/exact.log" ;;
        sweep)  timeout 200 python3 benchmarks/sweep_transfer.py ${SWEEP_ARGS:-} --out "$OUT/sweep-transfer${SWEEP_ARGS:+-contended}-h200.json" 2>&1 | tee "$OUT/sweep-transfer.log" ;;
        vllm-model8b) timeout 200 python3 benchmarks/bench_vllm.py model "$M8" --layers 32 --qk-bias-std "${QK_BIAS_STD:-0}" \
                2>&1 | tail -1 ;;
        vllm-check)
            [ -d /tmp/m ] || python3 benchmarks/vllm_check.py model /tmp/m 2>&1 | tail -1
            for mode in plain hotwindow; do
                timeout 200 python3 benchmarks/vllm_check.py $mode /tmp/m "$OUT/vc" > "$OUT/check-$mode.log" 2>&1
                quiet < "$OUT/check-$mode.log" | tail -6
            done
            python3 benchmarks/vllm_check.py compare "$OUT/vc" hotwindow 2>&1 | tail -12 ;;
        vllm-plain|vllm-tierkv|vllm-sparse|vllm-sparse-graphs|vllm-offloading|vllm-lmcache)
            mode=${step#vllm-}; case "$mode" in sparse*) mode=tierkv-$mode ;; esac
            timeout 240 $PIN python3 benchmarks/bench_vllm.py run $mode "$M8" "$BV" \
                ${PROFILE_STEPS:+--profile-steps $PROFILE_STEPS} ${VLLM_ARGS:-} > "$OUT/bench-$mode.log" 2>&1
            grep "^{" "$OUT/bench-$mode.log" | cut -c1-300 ;;
        vllm-table) python3 benchmarks/bench_vllm.py table "$BV" ;;
        vllm-ab)  # plain and sparse graphs alternating, REPEATS pairs (rows -r1, -r2, ...), each sparse row against
            # the plain row next to it; STORAGE_DTYPE picks the sparse rows' CPU tier (default bf16)
            for r in $(seq 1 "${REPEATS:-2}"); do
                for mode in plain ${SPARSE_MODE:-tierkv-sparse-graphs}; do
                    dtype=auto; own=""; [ "$mode" = plain ] || { dtype=${STORAGE_DTYPE:-auto}; own=${SPARSE_VLLM_ARGS:-}; }
                    timeout 200 $PIN python3 benchmarks/bench_vllm.py run $mode "$M8" "$BV" --tag "r$r" \
                        --storage-dtype $dtype ${VLLM_ARGS:-} $own > "$OUT/bench-$mode-r$r.log" 2>&1
                done
            done
            rm -f "$OUT"/bench-*.log
            python3 benchmarks/bench_vllm.py table "$BV" ;;
        vllm-compiled-quant)  # compiled vLLM: plain, then the sparse graphs over int8 and fp8 CPU tiers, REPEATS runs each
            timeout 200 $PIN python3 benchmarks/bench_vllm.py run plain "$M8" "$BV" --compiled ${VLLM_ARGS:-} \
                > "$OUT/bench-plain-compiled.log" 2>&1
            for dtype in int8 float8_e4m3fn; do
                for r in $(seq 1 "${REPEATS:-2}"); do
                    timeout 200 $PIN python3 benchmarks/bench_vllm.py run tierkv-sparse-graphs "$M8" "$BV" --compiled \
                        --storage-dtype $dtype --tag "r$r" ${VLLM_ARGS:-} > "$OUT/bench-$dtype-r$r.log" 2>&1
                done
            done
            rm -f "$OUT"/bench-*.log  # the rows' JSON comes back; the device returns few files
            python3 benchmarks/bench_vllm.py table "$BV" ;;
        vllm-sparse-check)  # whole step graphs against the split path, numerically (8 decode tokens, own OUT)
            CHECK_WHOLE_GRAPHS=${CHECK_WHOLE_GRAPHS:-64} timeout 150 python3 benchmarks/bench_vllm.py run \
                tierkv-sparse-graphs "$M8" "$OUT/check" --context 130880 --decode-tokens 8 --no-prefix \
                > "$OUT/check-whole.log" 2>&1
            python3 benchmarks/bench_vllm.py table "$OUT/check" | grep -i "graphs\|mode" ;;
        vllm-batch-plain|vllm-batch-sparse|vllm-batch-sparse-graphs)
            mode=${step#vllm-batch-}; [ "$mode" = plain ] || mode=tierkv-$mode
            timeout 400 python3 benchmarks/bench_vllm_batch.py run $mode "$M8" "$OUT/bb" ${BATCH_ARGS:-} \
                > "$OUT/batch-$mode.log" 2>&1
            grep "^{" "$OUT/batch-$mode.log" | cut -c1-300 ;;
        vllm-batch-sparse-graphs-fp8)  # fp8 CPU tier: half the host bytes per request (FP8_REQUESTS, default 10)
            timeout 500 python3 benchmarks/bench_vllm_batch.py run ${BATCH_MODE:-tierkv-sparse-graphs} "$M8" "$OUT/bb" \
                --storage-dtype float8_e4m3fn --requests ${FP8_REQUESTS:-10} ${BATCH_ARGS:-} > "$OUT/batch-fp8.log" 2>&1
            grep "^{" "$OUT/batch-fp8.log" | cut -c1-300 ;;
        vllm-batch-ab)  # REPEATS pairs (rows -r1, -r2, ...): plain, then BATCH_MODE over an fp8 CPU tier with
            # BATCH_ARGS, each against the plain row of its pair (the same host's speed)
            for r in $(seq "${REPEAT_FROM:-1}" "${REPEATS:-2}"); do
                timeout 200 python3 benchmarks/bench_vllm_batch.py run plain "$M8" "$OUT/bb" --compiled --tag "r$r" \
                    > "$OUT/batch-plain-r$r.log" 2>&1
                timeout 500 python3 benchmarks/bench_vllm_batch.py run ${BATCH_MODE:-tierkv-sparse-full} "$M8" "$OUT/bb" \
                    --storage-dtype float8_e4m3fn --requests ${FP8_REQUESTS:-10} --tag "r$r" ${BATCH_ARGS:---compiled} \
                    > "$OUT/batch-fp8-r$r.log" 2>&1
            done
            rm -f "$OUT"/batch-*-r*.log
            python3 benchmarks/bench_vllm_batch.py table "$OUT/bb" ;;
        vllm-batch-table) python3 benchmarks/bench_vllm_batch.py table "$OUT/bb" ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
    rc=$?
    summary+=("$step rc=$rc $(( $(date +%s) - start ))s")
done
echo "=== summary"
printf '%s\n' "${summary[@]}"
# the device returns at most 8 files from $OUT: past that, everything goes back in one archive
# (PACK_OUT=0 keeps the files as they are; unpack here with tar -xzf results.tar.gz)
if [ "${PACK_OUT:-1}" != 0 ] && [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
    tar -czf /tmp/results.tar.gz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/results.tar.gz "$OUT/"
    echo "more than 8 files: packed into \$OUT/results.tar.gz"
fi
