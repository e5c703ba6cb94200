#!/usr/bin/env bash
# One device call: every GPU test, then the GPU benchmarks, each bounded in time, full output under $OUT.
#   BENCH_GIT_COMMIT=<commit> bash benchmarks/gpu_session.sh [tests] [quant] [sparse] [sparse-tests] [exact]
#   sparse: SPARSE_PREDICTOR=previous|none|query picks the predictor, SPARSE_ARGS adds bench_sparse.py flags
set -uo pipefail
OUT="${OUT:-/tmp/tierkv-gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests quant sparse exact)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
summary=()
for step in "${steps[@]}"; do
    start=$(date +%s)
    case "$step" in
        tests)  timeout 300 python3 -m pytest -m gpu tests -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/gpu-tests.log" | tail -30 ;;
        quant-tests) timeout 200 python3 -m pytest -m gpu tests/gpu/test_quant_gpu.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests-quant.log" | tail -15 ;;
        quant)  timeout 240 python3 benchmarks/bench_quant.py --out "$OUT/quant-h200.json" 2>&1 | tee "$OUT/quant.log" ;;
        sparse) timeout 240 python3 benchmarks/bench_sparse.py --predictor ${SPARSE_PREDICTOR:-previous} ${SPARSE_ARGS:-} --out "$OUT/sparse-${SPARSE_PREDICTOR:-previous}-h200.json" 2>&1 | tee "$OUT/sparse-${SPARSE_PREDICTOR:-previous}.log" ;;
        sparse-tests) timeout 200 python3 -m pytest -m gpu tests/gpu/test_sparse_query_gpu.py -q -s -p no:cacheprovider -rs 2>&1 | tee "$OUT/gpu-tests-sparse.log" | tail -15 ;;
        exact)  timeout 300 python3 benchmarks/bench_exact.py --contexts 131072 --new-tokens 6 --no-offloaded --prefill-chunks ${PREFILL_CHUNKS:-32768} --transfer-backends ${TRANSFER_BACKENDS:-auto} --out "$OUT/exact-128k-h200.json" 2>&1 | tee "$OUT/exact.log" ;;
        sweep)  timeout 200 python3 benchmarks/sweep_transfer.py ${SWEEP_ARGS:-} --out "$OUT/sweep-transfer${SWEEP_ARGS:+-contended}-h200.json" 2>&1 | tee "$OUT/sweep-transfer.log" ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
    rc=$?
    summary+=("$step rc=$rc $(( $(date +%s) - start ))s")
done
echo "=== summary"
printf '%s\n' "${summary[@]}"
