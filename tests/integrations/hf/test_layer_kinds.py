"""Models whose layers are not each an attention with a KV of its own (hybrids with mamba / linear-attention /
conv layers, layers sharing another layer's KV), and models the query predictor cannot project queries for,
are refused by name when the TieredLLM is built, not by a raw error in the middle of a request."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from tests.models import small_config
from tierkv.config import ConfigError, load_config
from tierkv.config.load import to_dict
from tierkv.llm import TieredLLM

SMALL = dict(vocab_size=256, num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
_MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_expand=1)
HYBRIDS = {  # model -> (build, the layer kind named)
    "Lfm2": (lambda: tf.Lfm2ForCausalLM(tf.Lfm2Config(**SMALL, layer_types=["conv", "full_attention"])), "'conv'"),
    "Qwen3Next": (lambda: tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
        **SMALL, layer_types=["linear_attention", "full_attention"], head_dim=16, linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32)), "'linear_attention'"),
    "Jamba": (lambda: tf.JambaForCausalLM(tf.JambaConfig(
        **SMALL, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=2, mamba_d_state=4, mamba_expand=1, mamba_dt_rank=4)), "'mamba'"),
    "Bamba": (lambda: tf.BambaForCausalLM(tf.BambaConfig(**SMALL, attn_layer_indices=[1], **_MAMBA)),
              "'linear_attention'"),
    "FalconH1": (lambda: tf.FalconH1ForCausalLM(tf.FalconH1Config(**SMALL, head_dim=16, mamba_d_ssm=64, **_MAMBA)),
                 "'hybrid'"),
    "GraniteMoeHybrid": (lambda: tf.GraniteMoeHybridForCausalLM(tf.GraniteMoeHybridConfig(
        **SMALL, layer_types=["mamba", "attention"], num_local_experts=2, num_experts_per_tok=1, **_MAMBA)),
        "'linear_attention'"),
}


def _config(name: str, num_layers: int = 2, **scheduler):
    raw = to_dict(small_config(name, num_layers=num_layers, num_kv_heads=2, head_dim=16, prefill_chunk_tokens=16))
    raw["scheduler"].update(scheduler)
    return load_config(raw, env={})


@pytest.mark.parametrize("arch", sorted(HYBRIDS))
def test_a_hybrid_model_is_refused_at_construction_naming_its_other_layers(arch):
    build, kind = HYBRIDS[arch]
    model = build().eval()
    with pytest.raises(ValueError, match=rf"{arch}ForCausalLM is a hybrid model: its layers \[0.*{kind} layers"):
        TieredLLM(model, _config(arch.lower()), show_progress=False)


def test_layers_sharing_another_layers_kv_are_refused_at_construction():
    config = tf.Gemma3nTextConfig(num_hidden_layers=4, num_kv_shared_layers=2, head_dim=16, intermediate_size=[64] * 4,
                                  layer_types=["sliding_attention", "full_attention"] * 2,
                                  vocab_size_per_layer_input=256, hidden_size_per_layer_input=8, altup_num_inputs=2, laurel_rank=4,
                                  activation_sparsity_pattern=[0.0] * 4, sliding_window=512, vocab_size=256,
                                  hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    model = tf.Gemma3nForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"Gemma3nForCausalLM has layers that reuse another layer's keys and values "
                                         r"\(num_kv_shared_layers=2\)"):
        TieredLLM(model, _config("gemma3n", num_layers=4), show_progress=False)


_QUERY = dict(policy="sparse", predictor="query", cpu_far_reads="staged", sparse_token_budget=8)
POST_NORM = {
    "Olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**SMALL)),
    "Exaone4": lambda: tf.Exaone4ForCausalLM(tf.Exaone4Config(**SMALL, sliding_window=512,
                                                              layer_types=["full_attention"] * 2)),
}


@pytest.mark.parametrize("arch", sorted(POST_NORM))
def test_the_query_predictor_on_a_post_norm_model_is_refused_at_construction(arch):
    model = POST_NORM[arch]().eval()
    with pytest.raises(ConfigError, match=rf"input_layernorm\), which {arch}ForCausalLM's {arch}DecoderLayer "
                                          r"\(layer 0\) lacks.*use predictor 'previous'") as info:
        TieredLLM(model, _config(arch.lower(), **_QUERY), show_progress=False)
    assert info.value.key == "scheduler.predictor"
    assert model.config._attn_implementation != "tierkv"  # refused before the model was switched


def test_the_query_predictor_on_a_q_norm_over_the_whole_projection_is_refused():
    model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**SMALL, head_dim=16)).eval()
    model.model.layers[1].self_attn.q_norm = torch.nn.RMSNorm(64)  # Olmo 2's kind: over all heads at once
    with pytest.raises(ConfigError, match=r"q_norm spans 64 features \(the whole projection\)"):
        TieredLLM(model, _config("qwen3", **_QUERY), show_progress=False)


WORKING = {
    "Llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL)),
    "Qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL)),
    "Qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**SMALL, head_dim=16)),  # per-head q_norm
}


@pytest.mark.parametrize("arch", sorted(WORKING))
def test_the_query_predictor_still_serves_pre_norm_models(arch):
    torch.manual_seed(0)
    model = WORKING[arch]().eval()
    with TieredLLM(model, _config(arch.lower(), **_QUERY), show_progress=False) as llm:
        (out,) = llm.generate([list(range(1, 38))], max_new_tokens=4)
    assert len(out.token_ids) == 4
