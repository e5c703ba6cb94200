"""Models whose attention or KV is not what the runtime would be shaped for are refused by name when the
TieredLLM is built (or, where only the forward shows it, before anything is stored): no raw torch error."""
from __future__ import annotations

import pytest
import torch

from tests.models import build, small_config
from tierkv.config import ConfigError, load_config
from tierkv.llm import TieredLLM


def _config(**scheduler):
    config = small_config("t", num_layers=2, num_kv_heads=2, head_dim=16, prefill_chunk_tokens=16)
    from tierkv.config.load import to_dict

    data = to_dict(config)
    data["scheduler"].update(scheduler)
    return load_config(data, env={})


def test_a_config_shape_other_than_the_models_is_a_config_error():
    model, _ = build("llama")
    data = _config()
    from tierkv.config.load import to_dict

    raw = to_dict(data)
    raw["model"]["num_layers"] = 3
    with pytest.raises(ConfigError, match="the model has 2") as info:
        TieredLLM(model, load_config(raw, env={}), show_progress=False)
    assert info.value.key == "model.num_layers"


def test_a_k_proj_wider_than_the_configs_kv_heads_is_refused_at_construction():
    model, _ = build("llama")
    attn = model.model.layers[1].self_attn
    attn.k_proj = torch.nn.Linear(attn.k_proj.in_features, 4 * 16, bias=False)
    with pytest.raises(ValueError, match=r"layer 1's self_attn.k_proj gives 64 features; .* 2 KV heads x head_dim 16"):
        TieredLLM(model, _config(), show_progress=False)


def test_a_fused_attention_that_ignores_its_configs_kv_heads_is_refused_before_storing():
    """GPT-NeoX has no num_key_value_heads (its fused projection gives every head), so a config that carries one
    shapes the runtime narrower than the keys the attention computes."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = GPTNeoXForCausalLM(cfg).eval()
    config = small_config("neox", num_layers=2, num_kv_heads=2, head_dim=16, prefill_chunk_tokens=16)
    with TieredLLM(model, config, show_progress=False) as llm:
        with pytest.raises(ValueError, match=r"layer 0's attention gives keys of shape \(1, 4, \d+, 16\); the runtime "
                                             r"holds 2 KV heads x head_dim 16"):
            llm.generate([[1, 2, 3, 4, 5]], max_new_tokens=2)
        assert llm.runtime.cpu.used_bytes == 0  # nothing of the request was stored


def test_attention_soft_capping_is_refused_at_construction():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, attn_logit_softcapping=50.0, sliding_window=None,
                       max_position_embeddings=512)
    model = Gemma2ForCausalLM(cfg).eval()
    config = small_config("gemma2", num_layers=2, num_kv_heads=2, head_dim=16, prefill_chunk_tokens=16)
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=50.0"):
        TieredLLM(model, config, show_progress=False)


@pytest.mark.parametrize("factor", [0.5, 0.25])
def test_the_query_predictor_on_partial_rotary_is_refused_at_construction(factor):
    from transformers import PhiConfig, PhiForCausalLM

    cfg = PhiConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, partial_rotary_factor=factor, max_position_embeddings=512)
    model = PhiForCausalLM(cfg).eval()
    config = small_config("phi", num_layers=2, num_kv_heads=4, head_dim=16, prefill_chunk_tokens=16)
    from tierkv.config.load import to_dict

    raw = to_dict(config)
    raw["scheduler"].update(policy="sparse", predictor="query", sparse_token_budget=8)
    with pytest.raises(ConfigError, match=f"partial_rotary_factor={factor}") as info:
        TieredLLM(model, load_config(raw, env={}), show_progress=False)
    assert info.value.key == "scheduler.predictor"


def test_the_query_predictor_on_interleaved_rotary_is_refused_at_construction():
    from transformers import CohereConfig, CohereForCausalLM

    cfg = CohereConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, bos_token_id=None,
                       pad_token_id=None)
    model = CohereForCausalLM(cfg).eval()
    from tierkv.config.load import to_dict

    raw = to_dict(small_config("cohere", num_layers=2, num_kv_heads=2, head_dim=16, prefill_chunk_tokens=16))
    raw["scheduler"].update(policy="sparse", predictor="query", sparse_token_budget=8)
    with pytest.raises(ConfigError, match="interleaved pairs"):
        TieredLLM(model, load_config(raw, env={}), show_progress=False)


def test_a_lookahead_past_the_layers_is_named_not_the_staging_ring():
    model, _ = build("llama")
    with pytest.raises(ConfigError, match="the model has 2 layers") as info:
        TieredLLM(model, _config(lookahead_layers=100000), show_progress=False)
    assert info.value.key == "scheduler.lookahead_layers"


@pytest.mark.parametrize("encoding,message", [
    ({"input_ids": [[5, 6, 7, 8]], "attention_mask": [[1, 0, 1, 1]]}, "attention_mask is 0 at position 1, between 1s"),
    ({"input_ids": [[1.5, 6, 7]], "attention_mask": [[0, 1, 1]]}, "padding token 0 is 1.5"),
])
def test_a_masked_token_inside_a_prompt_or_a_non_integer_pad_is_refused(encoding, message):
    model, _ = build("llama")
    with TieredLLM(model, _config(), show_progress=False) as llm:
        with pytest.raises(ValueError, match=message):
            llm.generate(encoding, max_new_tokens=1)
        (out,) = llm.generate({"input_ids": [[0, 0, 5, 6, 7]], "attention_mask": [[0, 0, 1, 1, 1]]}, max_new_tokens=1)
    assert out.prompt_token_ids == [5, 6, 7]
