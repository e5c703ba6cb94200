"""What a TieredCache's blocks are addressed by must be what produced them: the token ids the model is fed
(else another prompt's KV would be filed under these tokens in the shared tiers), and the weights the
runtime was made for (else the old weights' KV would be served to the new ones)."""
from __future__ import annotations

import pytest
import torch

from tests.models import build
from tierkv.config import load_config
from tierkv.integrations.hf import TieredCache, forward_kwargs, runtime_for_model
from tierkv.llm import TieredLLM

BLOCK_BYTES = 2 * 2 * 4 * 16 * 4


def _config():
    return load_config({"cache": {"block_tokens": 4, "gpu_budget_bytes": 2 * 6 * BLOCK_BYTES, "sink_tokens": 4,
                                  "window_tokens": 8},
                        "tiers": [{"kind": "cpu", "capacity_bytes": "16MiB"}],
                        "scheduler": {"staging_bytes": 3 * 4 * BLOCK_BYTES}}, env={})


def test_feeding_other_ids_than_the_caches_is_refused_before_the_forward():
    model, reference = build("llama", num_heads=4, num_kv_heads=2)
    runtime = runtime_for_model(model, _config(), model_id="guard")
    try:
        ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))
        shifted = torch.cat([torch.tensor([[1]]), ids[:, :-1]], dim=1)  # BOS + ids[:-1]: a tokenizer slip
        cache = TieredCache(runtime, ids[0].tolist())
        with pytest.raises(ValueError, match=f"fed token {int(shifted[0, 0])} at position 0 where the cache's "
                                             f"token_ids hold {int(ids[0, 0])}"):
            model(shifted, **forward_kwargs(model, cache))
        assert cache.seq.num_tokens[0] == 0  # refused before any layer ran
        with pytest.raises(ValueError, match="must be fed input_ids"):
            model(inputs_embeds=model.get_input_embeddings()(ids), **forward_kwargs(model, cache))
        cache.finish()
        cache = TieredCache(runtime, ids[0].tolist())  # the right ids, then generated ones past them
        ours = model.generate(ids, **forward_kwargs(model, cache), max_new_tokens=6, do_sample=False)
        cache.finish()
        assert torch.equal(ours, reference.generate(ids, max_new_tokens=6, do_sample=False))
    finally:
        runtime.close()


def test_weights_changed_after_the_runtime_was_made_are_refused_and_unchanged_ones_pass():
    model, _ = build("llama", num_heads=4, num_kv_heads=2, seed=0)
    other, _ = build("llama", num_heads=4, num_kv_heads=2, seed=1)
    ids = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    with TieredLLM(model, _config(), show_progress=False) as llm:
        first = llm.generate([ids], max_new_tokens=4, ignore_eos=True)[0].token_ids
        model.load_state_dict(model.state_dict())  # in place, the same values: still the same model
        assert llm.generate([ids], max_new_tokens=4, ignore_eos=True)[0].token_ids == first
        model.load_state_dict(other.state_dict())  # in place, other values
        with pytest.raises(ValueError, match="weights changed after tierkv's runtime was made"):
            llm.generate([ids], max_new_tokens=4, ignore_eos=True)
        model.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(torch.zeros_like(
            model.model.layers[0].mlp.down_proj.weight))  # replaced, not updated
        with pytest.raises(ValueError, match="weights changed"):
            llm.generate([ids], max_new_tokens=4, ignore_eos=True)


def test_weights_written_through_data_are_refused():
    """`p.data.normal_()` moves no version counter: the probe digest on every check sees the values."""
    model, _ = build("llama", num_heads=4, num_kv_heads=2, seed=0)
    ids = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    with TieredLLM(model, _config(), show_progress=False) as llm:
        llm.generate([ids], max_new_tokens=4, ignore_eos=True)
        for p in model.parameters():
            p.data.normal_(0, 0.2)
        with pytest.raises(ValueError, match="weights changed after tierkv's runtime was made"):
            llm.generate([ids], max_new_tokens=4, ignore_eos=True)
