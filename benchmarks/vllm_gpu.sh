#!/usr/bin/env bash
# vLLM runs on the GPU machine, after the bundle's second staged call has sourced .vb/on-device.sh
# (../shared/device/vllm/README.md). Each engine runs in its own process; full output under $OUT.
#   source .vb/on-device.sh && BENCH_GIT_COMMIT=<commit> bash benchmarks/vllm_gpu.sh [steps...]
# steps: model8b (build the 8B-shaped checkpoint in /tmp/m8; can run in the first staged call,
#        it needs no vLLM), check (8-layer model: plain vs connector-only vs hot window, tokens and
#        logprobs), plain, tierkv, sparse, offloading (bench_vllm rows at 128k), table
set -uo pipefail
OUT="${OUT:-/tmp/tierkv-vllm-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
summary=()
quiet() { grep -v "^INFO\|^WARNING\|^(EngineCore\|^DEBUG\|^\[rank" || true; }
for step in "$@"; do
    start=$(date +%s)
    case "$step" in
        model8b) timeout 200 python3 benchmarks/bench_vllm.py model /tmp/m8 --layers 32 2>&1 | tail -1 ;;
        check)
            [ -d /tmp/m ] || python3 benchmarks/vllm_check.py model /tmp/m 2>&1 | tail -1
            for mode in plain hotwindow; do
                timeout 200 python3 benchmarks/vllm_check.py $mode /tmp/m "$OUT/vc" > "$OUT/check-$mode.log" 2>&1
                quiet < "$OUT/check-$mode.log" | tail -6
            done
            python3 benchmarks/vllm_check.py compare "$OUT/vc" hotwindow 2>&1 | tail -12 ;;
        plain|tierkv|offloading)  # PROFILE_STEPS="8 9 20 21": those engine steps under torch.profiler
            timeout 240 python3 benchmarks/bench_vllm.py run $step /tmp/m8 "$OUT/bv" \
                ${PROFILE_STEPS:+--profile-steps $PROFILE_STEPS} > "$OUT/bench-$step.log" 2>&1
            grep "^{" "$OUT/bench-$step.log" | cut -c1-300 ;;
        sparse)
            timeout 240 python3 benchmarks/bench_vllm.py run tierkv-sparse /tmp/m8 "$OUT/bv" > "$OUT/bench-sparse.log" 2>&1
            grep "^{" "$OUT/bench-sparse.log" | cut -c1-300 ;;
        table) python3 benchmarks/bench_vllm.py table "$OUT/bv" ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
    rc=$?
    summary+=("$step rc=$rc $(( $(date +%s) - start ))s")
done
echo "=== summary"
printf '%s\n' "${summary[@]}"
