#!/usr/bin/env bash
# each GPU test in its own process, launches blocking, short tracebacks under $OUT
OUT=${OUT:-/tmp/o}; mkdir -p $OUT
ids=$(python3 -m pytest -m gpu tests/gpu/test_far_graphs_gpu.py tests/vllm/test_far_cache.py tests/sparse/test_bounds_kernel.py tests/attention/test_triton.py::test_gpu_rows_of_ten_decoding_requests --collect-only -q -p no:cacheprovider 2>/dev/null | grep "::")
i=0
for id in $ids; do
  i=$((i+1))
  CUDA_LAUNCH_BLOCKING=1 timeout 120 python3 -m pytest "$id" -q -p no:cacheprovider --tb=short -W ignore > $OUT/t$i.log 2>&1
  echo "== $i $id rc=$?"
  grep -E "Error|error|assert|\.py:[0-9]+" $OUT/t$i.log | grep -v "CUDAEvent\|^frame\|site-packages" | head -25 | cut -c1-400
done
cd $OUT && tar czf logs.tgz t*.log && rm -f t*.log
