"""bench_vllm_batch's default decode length: long enough that some steps decode every request of the
batch after the last prefill, whatever chunk the engine prefills with (the shipped sparse config's
2048-token chunks take 64 steps per 128k prompt: a default of 32 per request left none on the H200)."""
from __future__ import annotations

import pytest

from benchmarks.bench_vllm_batch import FULL_BATCH_STEPS, MAX_MODEL_LEN, default_new_tokens


@pytest.mark.parametrize("requests,chunk", [(1, 8192), (3, 8192), (10, 2048), (10, 4096), (7, 3000)])
def test_the_default_new_tokens_outlast_every_requests_prefill(requests, chunk):
    steps_per_prompt = -(-MAX_MODEL_LEN // chunk)
    new = default_new_tokens(requests, chunk)
    # the first request decodes one token in each of the batch's prefill steps, then the batch decodes together
    assert new - requests * steps_per_prompt == FULL_BATCH_STEPS
    assert default_new_tokens(requests, chunk // 2) > new  # smaller chunks: more prefill steps to outlast
