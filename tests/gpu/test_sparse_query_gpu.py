"""GPU: the `query` sparse predictor on CUDA tensors — same outputs as `none`, counters that add
up (H2D bytes included, with the copy kernel skipping pairs on the device), and no host sync
inside prediction and selection when the cupy copy kernel is in use."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)

from tests.models import build  # noqa: E402
from tests.sparse.test_query_predictor import BLOCK_BYTES, NUM_KV_HEADS, hf_settings  # noqa: E402
from tierkv.integrations.hf import TieredCache, forward_kwargs, runtime_for_model  # noqa: E402
from tierkv.config import load_config  # noqa: E402
from tierkv.sparse.predict_query import QueryLookahead  # noqa: E402


@torch.no_grad()
def greedy(model, predictor: str, ids: list[int], num_new: int, **scheduler):
    runtime = runtime_for_model(model, load_config(hf_settings(predictor, num_layers=3, **scheduler), env={}),
                                model_id="query-gpu")
    try:
        before = runtime.stats()["transfer"]["h2d_bytes"]  # the engine's start-up self-test moved a few bytes
        cache = TieredCache(runtime, ids)
        kwargs = forward_kwargs(model, cache)
        logits = model(torch.tensor([ids], device="cuda"), **kwargs).logits[0, -1]  # one chunk: nothing streamed
        tokens, all_logits = [], [logits]
        for _ in range(num_new):
            tokens.append(int(torch.argmax(logits)))
            cache.seq.token_ids.append(tokens[-1])
            logits = model(torch.tensor([[tokens[-1]]], device="cuda"), **kwargs).logits[0, -1]
            all_logits.append(logits)
        reads = cache.seq.read_stats()
        query = getattr(cache.seq.predictor, "query", None)  # the query predictor's lookahead (none: no such part)
        cache.finish()
        stats = runtime.stats()
        stats["transfer"]["h2d_bytes"] -= before
        return tokens, all_logits, query, reads, stats
    finally:
        runtime.close()


def test_query_predictor_equals_none_and_counts_add_up_on_cuda():
    model, _ = build("llama", num_heads=4, num_kv_heads=NUM_KV_HEADS, num_layers=3)
    model = model.cuda()
    ids = torch.randint(0, 512, (250,)).tolist()
    none_tokens, none_logits, *_ = greedy(model, "none", ids, 8)
    tokens, logits, query, reads, stats = greedy(model, "query", ids, 8)
    assert tokens == none_tokens
    for got, want in zip(logits, none_logits):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    totals = query.totals()
    assert totals["hits"] + totals["misses"] == totals["needed"] == 4 * 3 * 8
    assert stats["transfer"]["h2d_bytes"] == (totals["copied"] + totals["misses"]) * BLOCK_BYTES
    assert stats["scheduler"]["stalls"] == totals["misses"]
    assert reads["streamed_block_reads"] == totals["misses"]


def test_prediction_and_selection_do_not_sync_the_host(monkeypatch):
    model, _ = build("llama", num_heads=4, num_kv_heads=NUM_KV_HEADS, num_layers=3)
    model = model.cuda()
    predict, chunks_for_layer = QueryLookahead.predict, QueryLookahead.chunks_for_layer

    def checked_predict(self, seq, layer):
        if self.rt.io.engine.backend not in ("cupy", "adaptive"):  # adaptive sends device slot lists to the kernel
            pytest.skip(f"the {self.rt.io.engine.backend} backend drops skipped pairs on the host")
        torch.cuda.set_sync_debug_mode("error")
        try:
            return predict(self, seq, layer)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def checked_chunks(self, seq, layer, q):
        chunks = chunks_for_layer(self, seq, layer, q)
        while True:
            torch.cuda.set_sync_debug_mode("error")
            try:
                chunk = next(chunks)
            except StopIteration:
                return
            finally:
                torch.cuda.set_sync_debug_mode("default")
            yield chunk

    monkeypatch.setattr(QueryLookahead, "predict", checked_predict)
    monkeypatch.setattr(QueryLookahead, "chunks_for_layer", checked_chunks)
    tokens, _, query, _, _ = greedy(model, "query", torch.randint(0, 512, (250,)).tolist(), 4)
    assert len(tokens) == 4 and query.totals()["needed"] == 4 * 3 * 4
