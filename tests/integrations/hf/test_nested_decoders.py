"""Causal LMs whose forward calls a nested decoder (OPT's `self.model.decoder`, Bart-family ForCausalLM) and
vision-language models (their language model) are guarded where every forward passes: they run exactly, or
are refused by name at construction."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from tests.models import pair, reference_greedy, small_config
from tierkv.integrations.hf import TieredCache, forward_kwargs, restore_attention
from tierkv.llm import TieredLLM

_IDS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=1)
_SEQ2SEQ = dict(vocab_size=256, d_model=64, decoder_layers=2, encoder_layers=2, decoder_attention_heads=4,
                encoder_attention_heads=4, decoder_ffn_dim=64, encoder_ffn_dim=64, decoder_start_token_id=0,
                max_position_embeddings=128, **_IDS)
NESTED = {
    "OPT": lambda: (tf.OPTForCausalLM, tf.OPTConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, ffn_dim=64,
                                                    num_attention_heads=4, word_embed_proj_dim=64, **_IDS)),
    "BioGpt": lambda: (tf.BioGptForCausalLM, tf.BioGptConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                                             num_attention_heads=4, intermediate_size=64, **_IDS)),
    "Bart": lambda: (tf.BartForCausalLM, tf.BartConfig(**_SEQ2SEQ)),
    "Marian": lambda: (tf.MarianForCausalLM, tf.MarianConfig(**_SEQ2SEQ)),
    "Pegasus": lambda: (tf.PegasusForCausalLM, tf.PegasusConfig(**_SEQ2SEQ)),
    "Whisper": lambda: (tf.WhisperForCausalLM, tf.WhisperConfig(**_SEQ2SEQ, max_target_positions=128,
                                                                suppress_tokens=None, begin_suppress_tokens=None)),
}


def _config(name: str):
    return small_config(name, num_layers=2, num_kv_heads=4, head_dim=16, prefill_chunk_tokens=16)


def _build(arch: str):
    cls, config = NESTED[arch]()
    model, reference = pair(cls, config, seed=0)
    generation = model.generation_config  # generation defaults of summarisers, not part of these tests
    generation.forced_eos_token_id = generation.forced_bos_token_id = None
    generation.no_repeat_ngram_size = generation.encoder_no_repeat_ngram_size = 0
    return model, reference


@pytest.mark.parametrize("arch", sorted(NESTED))
def test_a_causal_lm_calling_its_nested_decoder_generates_transformers_greedy_tokens(arch):
    model, reference = _build(arch)
    ids = list(range(3, 30))  # past the GPU budget: blocks streamed from the CPU tier
    expected, _ = reference_greedy(reference, ids, 6)
    with TieredLLM(model, _config(arch.lower()), show_progress=False) as llm:
        (out,) = llm.generate([ids], max_new_tokens=6)
    assert out.token_ids == expected


def test_the_guard_of_a_nested_decoder_still_refuses_another_attention():
    model, _ = _build("OPT")
    with TieredLLM(model, _config("opt"), show_progress=False) as llm:
        restore_attention(model)
        cache = TieredCache(llm.runtime, token_ids=[5, 6, 7])
        with pytest.raises(ValueError, match="the model's attention is 'sdpa'"):
            model(torch.tensor([[5, 6, 7]]), **forward_kwargs(model, cache))


def test_a_forward_given_encoder_states_is_refused_before_the_cross_attention_runs():
    model, _ = _build("Bart")
    with TieredLLM(model, _config("bart"), show_progress=False) as llm:
        cache = TieredCache(llm.runtime, token_ids=[5, 6, 7])
        with pytest.raises(ValueError, match="encoder_hidden_states would run the decoder's cross-attention"):
            model(torch.tensor([[5, 6, 7]]), encoder_hidden_states=torch.zeros(1, 4, 64),
                  **forward_kwargs(model, cache))
        assert llm.runtime.cpu.used_bytes == 0


def test_a_nested_decoder_computing_its_attention_itself_is_refused_by_name():
    config = tf.ProphetNetConfig(vocab_size=256, hidden_size=64, num_encoder_layers=2, num_decoder_layers=2,
                                 num_encoder_attention_heads=4, num_decoder_attention_heads=4, encoder_ffn_dim=64,
                                 decoder_ffn_dim=64, decoder_start_token_id=0, **_IDS)
    model = tf.ProphetNetForCausalLM(config).eval()
    with pytest.raises(ValueError, match="ProphetNetForCausalLM computes its attention itself"):
        TieredLLM(model, _config("prophetnet"), show_progress=False)


_TEXT = dict(vocab_size=256, num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
_MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
VISION_LANGUAGE = {
    "Qwen2VL": lambda: (tf.Qwen2VLForConditionalGeneration, tf.Qwen2VLConfig(
        text_config=dict(_TEXT, rope_parameters=_MROPE), image_token_id=250, video_token_id=251,
        vision_start_token_id=252, vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2))),
    "Llava": lambda: (tf.LlavaForConditionalGeneration, tf.LlavaConfig(
        text_config=tf.LlamaConfig(**_TEXT), image_token_id=250, vision_config=tf.CLIPVisionConfig(
            hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
            patch_size=14))),
}


@pytest.mark.parametrize("arch", sorted(VISION_LANGUAGE))
def test_a_vision_language_models_text_decoder_is_served_not_refused_for_its_vision_tower(arch):
    """The vision tower attends bidirectionally by design; only the language model's attention counts."""
    model, reference = pair(*VISION_LANGUAGE[arch](), seed=0)
    ids = list(range(3, 30))
    expected, _ = reference_greedy(reference, ids, 6)
    config = small_config(arch.lower(), num_layers=2, num_kv_heads=2, head_dim=16, prefill_chunk_tokens=16)
    with TieredLLM(model, config, show_progress=False) as llm:
        (out,) = llm.generate([ids], max_new_tokens=6)
    assert out.token_ids == expected


def test_a_decoder_with_more_layers_than_num_hidden_layers_is_refused_at_construction():
    """Bart-family configs take num_hidden_layers from encoder_layers: a decoder deeper than that would index
    past the runtime's layers."""
    model = tf.BartForCausalLM(tf.BartConfig(**dict(_SEQ2SEQ, decoder_layers=3))).eval()
    with pytest.raises(ValueError, match="BartForCausalLM's decoder has attention at layer_idx 2 where its config's "
                                         "num_hidden_layers, which tierkv's runtime is shaped by, is 2"):
        TieredLLM(model, _config("bart"), show_progress=False)


@pytest.mark.parametrize("arch", ["Bart", "Whisper"])
def test_a_decoder_with_other_counts_than_its_encoder_is_sized_by_the_decoder(arch):
    """Encoder-decoder families name the encoder's counts num_hidden_layers and num_attention_heads: the shape
    (and the KV budget, the tiers' block layout) comes from decoder_layers and decoder_attention_heads."""
    from tierkv.model_shape import model_shape

    cls = {"Bart": tf.BartForCausalLM, "Whisper": tf.WhisperForCausalLM}[arch]
    extra = {"max_target_positions": 128, "suppress_tokens": None, "begin_suppress_tokens": None} if arch == "Whisper" else {}
    config = getattr(tf, f"{arch}Config")(**{**_SEQ2SEQ, "encoder_layers": 3, "encoder_attention_heads": 8}, **extra)
    shape = model_shape(config)
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (2, 4, 4, 16)
    assert shape.max_position_embeddings == 128
    model, reference = pair(cls, config, seed=0)
    generation = model.generation_config
    generation.forced_eos_token_id = generation.forced_bos_token_id = None
    generation.no_repeat_ngram_size = generation.encoder_no_repeat_ngram_size = 0
    ids = list(range(3, 30))
    expected, _ = reference_greedy(reference, ids, 6)
    with TieredLLM(model, _config(arch.lower()), show_progress=False) as llm:
        assert llm.runtime.num_layers == 2
        (out,) = llm.generate([ids], max_new_tokens=6)
    assert out.token_ids == expected
