"""TieredLLM: batches of uneven requests, prefix reuse across tiers, refusals before work."""
from __future__ import annotations

import pytest
import torch

from tests.models import build, reference_greedy
from tierkv.config import load_config
from tierkv.llm import TieredLLM
from tierkv.sampling import SamplingParams
from tierkv.engine.sequence import CapacityError

BLOCK_BYTES = 2 * 2 * 4 * 16 * 4  # K+V, 2 kv heads, 4 tokens, head_dim 16, fp32


def make_llm(tmp_path, cpu_blocks: int = 4096):
    model, reference = build("llama", num_heads=8, num_kv_heads=2)
    config = load_config({
        "model": {"name": "test-llama"},
        "cache": {"block_tokens": 4, "gpu_budget_bytes": 2 * 6 * BLOCK_BYTES, "sink_tokens": 4, "window_tokens": 8},
        "tiers": [{"kind": "cpu", "capacity_bytes": cpu_blocks * BLOCK_BYTES},
                  {"kind": "disk", "path": str(tmp_path / "disk"), "capacity_bytes": "64MiB", "trusted": True}],
        "scheduler": {"lookahead_layers": 1, "staging_bytes": 2 * 4 * BLOCK_BYTES, "prefill_chunk_tokens": 64},
    }, env={})
    return TieredLLM(model, config, show_progress=False), reference


def test_batch_of_uneven_requests_matches_dynamic_cache(tmp_path):
    llm, reference = make_llm(tmp_path)
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (37, 301, 130)]
    with llm:
        outputs = llm.generate(prompts, SamplingParams(max_new_tokens=6))
        for prompt, out in zip(prompts, outputs):
            expected, _ = reference_greedy(reference, prompt, 6)
            assert out.token_ids == expected
            assert out.finish_reason == "length"
            assert out.prompt_token_ids == prompt
        totals = llm.stats()["requests"]
    assert totals["requests"] == 3 and totals["generated_tokens"] == 18
    assert totals["prompt_tokens"] == 37 + 301 + 130


def test_repeated_prompt_reuses_its_prefix_and_gives_the_same_tokens(tmp_path):
    llm, _ = make_llm(tmp_path)
    prompt = torch.randint(0, 512, (203,)).tolist()
    with llm:
        (first,) = llm.generate([prompt], max_new_tokens=5)
        (second,) = llm.generate([prompt], max_new_tokens=5)
    assert first.stats["prefix_tokens"] == 0
    assert second.stats["prefix_tokens"] == 200  # all full blocks but the one holding the last token
    assert second.stats["prefix_blocks_by_tier"] == {"cpu": 2 * 50}
    assert second.token_ids == first.token_ids


def test_prefix_comes_back_from_disk_after_the_cpu_tier_spilled_it(tmp_path):
    llm, _ = make_llm(tmp_path, cpu_blocks=120)  # one 203-token request (~104 blocks) at a time
    prompt_a = torch.randint(0, 512, (203,)).tolist()
    prompt_b = torch.randint(0, 512, (203,)).tolist()
    with llm:
        (a1,) = llm.generate([prompt_a], max_new_tokens=3)
        llm.generate([prompt_b], max_new_tokens=3)
        llm.runtime.chain.flush()
        (a2,) = llm.generate([prompt_a], max_new_tokens=3)
        stats = llm.stats()
    assert a2.stats["prefix_tokens"] == 200
    assert a2.stats["prefix_blocks_by_tier"].get("disk", 0) > 0
    assert a2.token_ids == a1.token_ids
    assert stats["chain"]["dropped"] == 0 and stats["chain"]["promoted"] > 0


def test_request_larger_than_the_cpu_tier_is_refused_before_any_work(tmp_path):
    llm, _ = make_llm(tmp_path, cpu_blocks=64)
    with llm:
        with pytest.raises(CapacityError, match=r"request 1: .*tiers\[0\]\.capacity_bytes"):
            llm.generate([[1, 2, 3], list(range(200))], max_new_tokens=4)
        assert llm.stats()["requests"]["requests"] == 0


@pytest.mark.parametrize("prompt,message", [
    ([], "request 0: the prompt is empty"),
    ([1, 2, 512], "request 0: token 2 is 512"),
    ([1, -3], "token 1 is -3"),
    ([1, 2.5], "token 1 is 2.5"),
    ("some text", "needs a tokenizer"),
])
def test_bad_prompts_are_named(tmp_path, prompt, message):
    llm, _ = make_llm(tmp_path)
    with llm, pytest.raises(ValueError, match=message):
        llm.generate([prompt], max_new_tokens=2)


def test_bad_sampling_and_backend(tmp_path):
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="backend: got 'tensorrt'"):
        TieredLLM(None, None, backend="tensorrt")


def test_sampling_with_a_seed_is_reproducible(tmp_path):
    llm, _ = make_llm(tmp_path)
    prompt = torch.randint(0, 512, (50,)).tolist()
    params = SamplingParams(max_new_tokens=8, temperature=0.8, top_k=50, top_p=0.9, seed=123)
    with llm:
        (a,) = llm.generate([prompt], params)
        (b,) = llm.generate([prompt], params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8


def sparse_llm(tmp_path, model, predictor: str, budget_tokens: int, **scheduler):
    config = load_config({
        "model": {"name": "test-llama"},
        "cache": {"block_tokens": 4, "gpu_budget_bytes": 2 * 6 * BLOCK_BYTES, "sink_tokens": 4, "window_tokens": 8},
        "tiers": [{"kind": "cpu", "capacity_bytes": 4096 * BLOCK_BYTES},
                  {"kind": "disk", "path": str(tmp_path / f"disk-{predictor}-{budget_tokens}"), "capacity_bytes": "64MiB", "trusted": True}],
        "scheduler": {"cpu_far_reads": "staged", "lookahead_layers": 1,
                      "staging_bytes": 2 * 2 * (budget_tokens // 4) * BLOCK_BYTES,
                      "prefill_chunk_tokens": 64, "policy": "sparse", "sparse_token_budget": budget_tokens,
                      "predictor": predictor, **scheduler},
    }, env={})
    return TieredLLM(model, config, show_progress=False)


def test_sparse_predictor_cache_with_a_prefetch_margin_through_tiered_llm(tmp_path):
    """TieredLLM with predictor 'cache', caches of two selections and a margin: a budget over the
    longest request equals exact decoding (DynamicCache's tokens); a small one gives predictor none's
    tokens, and the stats carry its stalls, the margin's precision and the bytes it copied."""
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (37, 301, 130)]
    margin = {"sparse_cache_selections": 2, "sparse_prefetch_margin": 4}
    model, reference = build("llama", num_heads=8, num_kv_heads=2)
    llm = sparse_llm(tmp_path, model, "cache", 320, **margin)
    with llm:
        outputs = llm.generate(prompts, SamplingParams(max_new_tokens=6))
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == reference_greedy(reference, prompt, 6)[0]
    tokens = {}
    for predictor, extra in (("none", {}), ("cache", margin)):
        llm = sparse_llm(tmp_path, model, predictor, 32, **extra)
        with llm:
            tokens[predictor] = [out.token_ids for out in llm.generate(prompts, SamplingParams(max_new_tokens=6))]
            stats = llm.stats()
    assert tokens["cache"] == tokens["none"]
    assert stats["scheduler"]["stalls"] > 0 and stats["scheduler"]["far_cache_copied_bytes"] > 0
    assert stats["prefetch"]["precision"] is not None


def test_a_closed_tieredllm_refuses_work_and_close_waits_for_the_running_request():
    import threading
    import time

    import pytest

    import tierkv.llm as llm_module
    from tests.models import build
    from tierkv.llm import TieredLLM

    model, _ = build("llama", num_heads=8, num_kv_heads=2)
    llm = TieredLLM(model, {"cache": {"block_tokens": 4, "gpu_budget_bytes": 2 * 6 * 1024, "sink_tokens": 4,
                                      "window_tokens": 8},
                            "tiers": [{"kind": "cpu", "capacity_bytes": "16MiB"}],
                            "scheduler": {"lookahead_layers": 1, "staging_bytes": 8192, "prefill_chunk_tokens": 64}},
                    show_progress=False)
    want = llm.generate([list(range(1, 40))], max_new_tokens=6)[0].token_ids
    sample, started, closed = llm_module.sample_next, threading.Event(), {}

    def slow(logits, params, generator):
        started.set()
        time.sleep(0.05)
        return sample(logits, params, generator)

    llm_module.sample_next = slow
    try:
        out = {}
        worker = threading.Thread(target=lambda: out.setdefault("tokens", llm.generate([list(range(1, 40))],
                                                                                         max_new_tokens=6)))
        worker.start()
        started.wait(10)
        closer = threading.Thread(target=lambda: (llm.close(), closed.setdefault("at", time.monotonic())))
        closer.start()
        worker.join(30)
        closer.join(30)
    finally:
        llm_module.sample_next = sample
    assert out["tokens"][0].token_ids == want  # the running request ended whole before close released anything
    assert "at" in closed
    with pytest.raises(RuntimeError, match="this TieredLLM is closed"):
        llm.generate([list(range(1, 40))], max_new_tokens=2)
    with pytest.raises(RuntimeError, match="this TieredLLM is closed"):
        llm.set_gpu_budget("1MiB")
    llm.close()  # twice is fine


def test_sampling_fields_set_after_construction_are_checked_and_max_tokens_reads_back(tmp_path):
    import numpy as np

    llm, _ = make_llm(tmp_path)
    prompt = torch.randint(0, 512, (20,)).tolist()
    with llm:
        params = SamplingParams(max_tokens=5)
        assert params.max_tokens == 5
        params.max_tokens = 2  # vLLM's name, set after construction
        assert len(llm.generate([prompt], params)[0].token_ids) == 2
        params = SamplingParams(max_tokens=3, temperature=1.0)
        params.top_k = 0
        with pytest.raises(ValueError, match="top_k: got 0"):
            llm.generate([prompt], params)
        params = SamplingParams(max_tokens=3)
        params.max_new_tokens = 0
        with pytest.raises(ValueError, match="max_new_tokens: got 0"):
            llm.generate([prompt], params)
        # a NumPy seed is taken as the int it is (torch.Generator takes Python ints only)
        a = llm.generate([prompt], max_tokens=4, temperature=0.9, seed=np.int64(7))[0].token_ids
        b = llm.generate([prompt], max_tokens=4, temperature=0.9, seed=7)[0].token_ids
        assert a == b


def test_request_outputs_carry_their_prompt_and_request_id(tmp_path):
    llm, _ = make_llm(tmp_path)
    with llm:
        outs = llm.generate([[5, 6, 7], [8, 9]], max_tokens=2, ignore_eos=True)
    assert [o.request_id for o in outs] == ["0", "1"] and [o.prompt for o in outs] == [None, None]


def test_the_tokenizers_eos_stops_a_request_as_under_vllm(tmp_path):
    """The generation config names no EOS; the tokenizer does: vLLM stops there unless ignore_eos."""
    llm, _ = make_llm(tmp_path)
    llm.model.generation_config.eos_token_id = None
    prompt = torch.randint(0, 512, (20,)).tolist()
    with llm:
        free = llm.generate([prompt], max_tokens=6, ignore_eos=True)[0].token_ids
        stop = free[2]

        class Tok:
            eos_token_id = stop

            def decode(self, ids, skip_special_tokens=True):
                return " ".join(map(str, ids))

        llm.tokenizer = Tok()
        out = llm.generate([prompt], max_tokens=6)[0]
        assert out.token_ids == free[: free.index(stop) + 1] and out.finish_reason == "stop"
        assert llm.generate([prompt], max_tokens=6, ignore_eos=True)[0].token_ids == free


@pytest.mark.parametrize("prompt_len,new_tokens", [(40, 1), (40, 2), (37, 4), (39, 2), (1, 1), (8, 9)])
def test_a_request_fits_a_cpu_tier_of_exactly_its_kv_blocks(tmp_path, prompt_len, new_tokens):
    """The KV a request writes is its prompt and every new token but the last (never fed back): a CPU tier of
    exactly those blocks serves it, one block less refuses it before any work."""
    blocks = -(-(prompt_len + new_tokens - 1) // 4) * 2  # 4-token blocks, 2 layers
    prompt = torch.randint(0, 512, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    llm, reference = make_llm(tmp_path, cpu_blocks=blocks)
    with llm:
        (out,) = llm.generate([prompt], max_new_tokens=new_tokens)
    assert out.token_ids == reference_greedy(reference, prompt, new_tokens)[0]
    small, _ = make_llm(tmp_path / "small", cpu_blocks=blocks - 1)
    with small, pytest.raises(CapacityError, match=f"needs {blocks} KV blocks"):
        small.generate([prompt], max_new_tokens=new_tokens)


def test_a_lower_tier_raising_during_a_prefix_read_is_a_miss_and_leaks_no_pin(tmp_path, monkeypatch):
    """A disk read that raises (an OS error its own handling missed, e.g. close(2) failing on NFS) is counted and
    read as misses: the prompt is recomputed to the same tokens, no CPU-tier slot stays pinned, and the next
    request that needs the whole CPU tier is served (it was refused as if the tier were full)."""
    llm, reference = make_llm(tmp_path, cpu_blocks=120)  # one 203-token request (~104 blocks) at a time
    prompt_a = torch.randint(0, 512, (203,), generator=torch.Generator().manual_seed(1)).tolist()
    prompt_b = torch.randint(0, 512, (203,), generator=torch.Generator().manual_seed(2)).tolist()
    with llm:
        llm.generate([prompt_a], max_new_tokens=3)
        llm.generate([prompt_b], max_new_tokens=3)
        llm.runtime.chain.flush()
        disk = llm.runtime.chain.tiers[1]

        def failing_read(keys):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(disk, "get_many", failing_read)
        (again,) = llm.generate([prompt_a + [7] * 20], max_new_tokens=3)
        assert again.token_ids == reference_greedy(reference, prompt_a + [7] * 20, 3)[0]
        assert disk.counters.snapshot()["errors"] >= 1
        assert not +llm.runtime.cpu._pins  # (a Counter: no key pinned once the request is done)
        monkeypatch.undo()
        (whole,) = llm.generate([list(range(1, 230))], max_new_tokens=3)  # 229 + 2 tokens: 116 of the 120 blocks
    assert whole.token_ids == reference_greedy(reference, list(range(1, 230)), 3)[0]
