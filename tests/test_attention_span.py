"""Models whose layers attend only part of the context (a sliding window: Mistral, Qwen2 with
use_sliding_window; chunked attention: Llama 4): tierkv attends every earlier token, which is their
attention exactly while a sequence stays within the window or chunk. Within it, tokens equal
transformers'; past it, TieredLLM refuses the request before any work, naming the setting, and a
TieredCache used directly refuses to grow past it (never a silently different attention)."""
from __future__ import annotations

import pytest
import torch

from tests.models import pair, reference_greedy, small_config
from tierkv.config import load_config
from tierkv.integrations.model_support import attention_span
from tierkv.llm import TieredLLM
from tierkv.prompts import PromptError


def _models():
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, eos_token_id=None, bos_token_id=None)
    yield "mistral", tf.MistralForCausalLM, tf.MistralConfig(**common, sliding_window=48), 48
    yield "qwen2", tf.Qwen2ForCausalLM, tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=40,
                                                       max_window_layers=0), 40
    if hasattr(tf, "Llama4TextConfig"):
        cfg = tf.Llama4TextConfig(**{**common, "num_hidden_layers": 4}, intermediate_size_mlp=64, num_local_experts=2,
                                  attention_chunk_size=32, pad_token_id=None)
        yield "llama4", tf.Llama4ForCausalLM, cfg, 32


MODELS = list(_models())


def _config(tmp_path):
    return small_config("span", num_layers=4, num_kv_heads=2, head_dim=16, prefill_chunk_tokens=16)


@pytest.mark.parametrize("name,cls,config,span", MODELS, ids=[m[0] for m in MODELS])
def test_within_the_span_tokens_equal_transformers_and_past_it_the_request_is_refused(tmp_path, name, cls, config,
                                                                                       span):
    model, reference = pair(cls, config, seed=0)
    assert attention_span(model)[0] == span
    ids = torch.randint(0, 256, (span - 8,), generator=torch.Generator().manual_seed(1)).tolist()
    want, _ = reference_greedy(reference, ids, 9)  # the 9th new token is never fed: the sequence is `span` tokens
    with TieredLLM(model, _config(tmp_path), show_progress=False) as llm:
        assert llm.generate([ids], max_new_tokens=9, ignore_eos=True)[0].token_ids == want
        before = llm.stats()["requests"]["requests"]
        with pytest.raises(PromptError, match=f"request 0: {span - 8} prompt tokens .* - 1 = {span + 1}; .* at most "
                                              f"{span} tokens"):
            llm.generate([ids], max_new_tokens=10, ignore_eos=True)
        with pytest.raises(PromptError, match="sliding_window|attention_chunk_size"):
            llm.generate([ids + ids], max_new_tokens=1)
        assert before == 1 and llm.stats()["requests"]["requests"] == before  # refused before any work


def test_models_that_attend_the_whole_context_have_no_span():
    import transformers as tf

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1)
    assert attention_span(tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=None))) is None
    assert attention_span(tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, use_sliding_window=False))) is None
    assert attention_span(tf.LlamaForCausalLM(tf.LlamaConfig(**common))) is None


def test_a_tiered_cache_used_directly_refuses_to_grow_past_the_span(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    from tierkv.integrations.hf import TieredCache, forward_kwargs, runtime_for_model

    config = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24)
    model, _ = pair(MistralForCausalLM, config, seed=0)
    runtime = runtime_for_model(model, _config(tmp_path))
    cache = TieredCache(runtime)
    try:
        model(torch.tensor([list(range(20))]), **forward_kwargs(model, cache))
        with pytest.raises(ValueError, match="sliding_window=24.*reaches 25 tokens"):
            model(torch.tensor([list(range(5))]), **forward_kwargs(model, cache))
    finally:
        cache.finish()
        runtime.close()


@pytest.mark.parametrize("arch", ["Bloom", "GPTNeo", "XGLM", "DeepseekV3", "FalconAlibi", "Gemma3Bidirectional"])
def test_models_tierkv_cannot_serve_are_refused_naming_why(tmp_path, arch):
    import transformers as tf

    from tierkv.integrations.hf import runtime_for_model

    small = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    config = {"Bloom": lambda: tf.BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=2),
              "GPTNeo": lambda: tf.GPTNeoConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=2,
                                                attention_types=[[["global"], 2]]),
              "XGLM": lambda: tf.XGLMConfig(vocab_size=128, d_model=32, num_layers=2, attention_heads=2, ffn_dim=32),
              "DeepseekV3": lambda: tf.DeepseekV3Config(**small, intermediate_size=32, moe_intermediate_size=16,
                                                        num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=16,
                                                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                                        n_routed_experts=2, num_experts_per_tok=1,
                                                        first_k_dense_replace=2),
              "FalconAlibi": lambda: tf.FalconConfig(**small, alibi=True),
              "Gemma3Bidirectional": lambda: tf.Gemma3TextConfig(**small, intermediate_size=32, num_key_value_heads=1,
                                                                 head_dim=16, use_bidirectional_attention=True)}[arch]()
    model = {"FalconAlibi": tf.FalconForCausalLM, "Gemma3Bidirectional": tf.Gemma3ForCausalLM}.get(
        arch, getattr(tf, f"{arch}ForCausalLM", None))(config)
    why = {"DeepseekV3": "multi-head latent attention", "FalconAlibi": "alibi=True computes its ALiBi attention itself",
           "Gemma3Bidirectional": "attends bidirectionally"}.get(arch, "computes its attention itself")
    with pytest.raises(ValueError, match=why):
        runtime_for_model(model, _config(tmp_path))


def test_the_query_predictor_needs_a_q_projection(tmp_path):
    import transformers as tf

    from tierkv.config import ConfigError
    from tierkv.integrations.hf import check_query_predictor_fits

    model = tf.Phi3ForCausalLM(tf.Phi3Config(vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=2, pad_token_id=0))
    with pytest.raises(ConfigError, match="Phi3Attention lacks"):
        check_query_predictor_fits(model, 16)


def test_a_sparse_budget_below_one_block_is_refused():
    from tierkv.config import ConfigError

    with pytest.raises(ConfigError, match="sparse_token_budget.*whole far blocks of cache.block_tokens \\(16\\)"):
        load_config({"cache": {"block_tokens": 16}, "scheduler": {"policy": "sparse", "sparse_token_budget": 8}},
                    env={})


def test_a_request_crossing_a_longrope_switch_while_decoding_is_refused_and_the_others_equal_transformers(tmp_path):
    """Phi-3 with rope_type longrope: transformers' generation recomputes the whole sequence with the long
    factors when it first passes original_max_position_embeddings; a request that would pass it while
    decoding is refused before any work, one that stays below or starts above it is served exactly."""
    import transformers as tf

    config = tf.Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, max_position_embeddings=64,
                           original_max_position_embeddings=8, eos_token_id=None, bos_token_id=None,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                            "long_factor": [4.0] * 8, "original_max_position_embeddings": 8})
    model, reference = pair(tf.Phi3ForCausalLM, config, seed=0)
    with TieredLLM(model, small_config("phi3", num_layers=2, num_kv_heads=2, head_dim=16, prefill_chunk_tokens=7),
                   show_progress=False) as llm:
        for length, new in ((2, 7), (9, 6), (20, 6)):  # 2 + 7 - 1 = 8 tokens fed: at the switch, not past it
            ids = torch.randint(1, 128, (length,), generator=torch.Generator().manual_seed(length)).tolist()
            want = reference.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=0,
                                      attention_mask=torch.ones(1, length, dtype=torch.long))[0, length:].tolist()
            assert llm.generate([ids], max_new_tokens=new, ignore_eos=True)[0].token_ids == want, length
        for length, new in ((2, 8), (5, 6), (8, 2)):
            with pytest.raises(PromptError, match=f"original_max_position_embeddings=8 while decoding.*at most "
                                                  f"{8 - length + 1} new tokens"):
                llm.generate([list(range(1, length + 1))], max_new_tokens=new)
