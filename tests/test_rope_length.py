"""Rotary embeddings whose frequencies depend on the forward's longest position (rope_type dynamic, as
in dynamic NTK scaling, and longrope, as in Phi-3's 128k models): a prompt prefilled in chunks is
rotated as one forward over the whole prompt rotates it (`hf.RotaryForLength`), so exact mode equals
transformers at every step whatever `scheduler.prefill_chunk_tokens`; and no prefix is reused across
requests of such a model (its keys depend on the request's length)."""
from __future__ import annotations

import pytest
import torch

from tests.models import pair, reference_greedy, small_config
from tierkv.integrations.model_support import length_dependent_rotary
from tierkv.llm import TieredLLM

ROPES = {"dynamic": ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, 64),
         "longrope": ({"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [4.0] * 16,
                       "original_max_position_embeddings": 64, "rope_theta": 10000.0}, 256)}


def _pair(rope: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    parameters, max_positions = ROPES[rope]
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=max_positions, rope_parameters=parameters, eos_token_id=None,
                         bos_token_id=None)
    return pair(LlamaForCausalLM, config, seed=0)


def _config(tmp_path, chunk: int):
    return small_config("rope", num_layers=2, num_kv_heads=2, head_dim=32, prefill_chunk_tokens=chunk)


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("chunk", [16, 64, 256])
def test_a_chunked_prefill_rotates_as_one_forward_and_tokens_equal_transformers(tmp_path, rope, chunk, monkeypatch):
    import tierkv.llm as llm_module

    model, reference = _pair(rope)
    assert len(length_dependent_rotary(model)) == 1
    ids = torch.randint(0, 256, (130,), generator=torch.Generator().manual_seed(1)).tolist()
    want, want_logits = reference_greedy(reference, ids, 8)
    seen = []
    sample = llm_module.sample_next
    monkeypatch.setattr(llm_module, "sample_next", lambda logits, *a, **k: (seen.append(logits.clone()),
                                                                             sample(logits, *a, **k))[1])
    with TieredLLM(model, _config(tmp_path, chunk), show_progress=False) as llm:
        first = llm.generate([ids], max_new_tokens=8, ignore_eos=True)[0]
        again = llm.generate([ids], max_new_tokens=8, ignore_eos=True)[0]
    assert first.token_ids == want and again.token_ids == want
    for got, expected in zip(seen[:8], want_logits[:8]):
        torch.testing.assert_close(got.float(), expected.float(), rtol=1e-4, atol=1e-4)
    assert again.stats["prefix_tokens"] == 0  # keys depend on the request's length: nothing reused
    assert "forward" not in vars(length_dependent_rotary(model)[0])  # the module's own forward again


def test_plain_rope_models_have_no_length_dependent_rotary():
    from tests.models import build

    assert length_dependent_rotary(build("llama")[0]) == []
