"""The checkpoint's generation_config: tierkv's greedy tokens equal transformers' generate(do_sample=False)
with its repetition_penalty, min_new_tokens and min_length; what tierkv does not implement is refused by name."""
from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings, strategies as st
from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

from tierkv.config import load_config
from tierkv.generation_defaults import LogitsRules
from tierkv.llm import TieredLLM
from tierkv.sampling import SamplingParams

VOCAB, NEW_TOKENS = 256, 8
BLOCK_BYTES = 1024  # K+V, 2 kv heads, 4 tokens, head_dim 16, fp32
PROMPT = list(range(3, 23))


@pytest.fixture(scope="module")
def model_and_llm():
    """A tiny seeded Llama (weights wide enough that its greedy tokens repeat) and its TieredLLM."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()
    for param in model.parameters():
        param.data.normal_(0, 0.2)
    config = load_config({
        "cache": {"block_tokens": 4, "gpu_budget_bytes": 2 * 8 * BLOCK_BYTES, "sink_tokens": 4, "window_tokens": 8},
        "tiers": [{"kind": "cpu", "capacity_bytes": 4096 * BLOCK_BYTES}],
        "scheduler": {"lookahead_layers": 1, "staging_bytes": 128 * BLOCK_BYTES}}, env={})
    with TieredLLM(model, config, show_progress=False) as llm:
        yield model, llm


@pytest.fixture
def model(model_and_llm):
    """The model with a fresh generation_config for each test."""
    model, _ = model_and_llm
    model.generation_config = transformers.GenerationConfig()
    return model


@pytest.fixture
def llm(model_and_llm, model):
    return model_and_llm[1]


def transformers_greedy(model, prompt: list[int], **settings) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS, **settings)
    return out[0, len(prompt):].tolist()


def tierkv_greedy(llm, prompt: list[int], sampling: SamplingParams | None = None) -> list[int]:
    return llm.generate([prompt], sampling or SamplingParams(max_new_tokens=NEW_TOKENS))[0].token_ids


@pytest.mark.parametrize("penalty", [0.6, 1.05, 1.5, 3.0])
def test_the_checkpoints_repetition_penalty_is_applied(model, llm, penalty):
    plain = transformers_greedy(model, PROMPT)
    model.generation_config.repetition_penalty = penalty
    want = transformers_greedy(model, PROMPT)
    assert tierkv_greedy(llm, PROMPT) == want
    if penalty == 1.5:  # the setting changes this model's tokens: dropping it would not pass
        assert want != plain


@settings(max_examples=12, deadline=None)
@given(penalty=st.floats(0.3, 4.0), seed=st.integers(0, 2**16))
def test_any_repetition_penalty_matches_transformers(model_and_llm, penalty, seed):
    model, llm = model_and_llm
    model.generation_config = transformers.GenerationConfig(repetition_penalty=penalty)
    prompt = torch.randint(0, VOCAB, (17,), generator=torch.Generator().manual_seed(seed)).tolist()
    assert tierkv_greedy(llm, prompt) == transformers_greedy(model, prompt)


def early_eos(model) -> int:
    """A token this model emits second for PROMPT, made its EOS: greedy decoding stops after 2 tokens."""
    eos = transformers_greedy(model, PROMPT)[1]
    model.generation_config.eos_token_id = eos
    return eos


@pytest.mark.parametrize("setting", ["min_new_tokens", "min_length"])
def test_min_new_tokens_and_min_length_hold_back_eos(model, llm, setting):
    eos = early_eos(model)
    assert tierkv_greedy(llm, PROMPT) == transformers_greedy(model, PROMPT) and len(tierkv_greedy(llm, PROMPT)) == 2
    setattr(model.generation_config, setting, 5 if setting == "min_new_tokens" else len(PROMPT) + 5)
    want = transformers_greedy(model, PROMPT)
    got = tierkv_greedy(llm, PROMPT)
    assert got == want and len(got) >= 5 and eos not in got[:5]


def test_a_min_length_shorter_than_the_prompt_holds_back_nothing(model, llm):
    early_eos(model)
    model.generation_config.min_length = len(PROMPT) - 3
    assert tierkv_greedy(llm, PROMPT) == transformers_greedy(model, PROMPT) and len(tierkv_greedy(llm, PROMPT)) == 2


def test_explicit_sampling_params_override_the_generation_config(model, llm):
    model.generation_config.repetition_penalty = 1.5
    for penalty in (1.0, 2.0, 0.8):
        sampling = SamplingParams(max_new_tokens=NEW_TOKENS, repetition_penalty=penalty)
        assert tierkv_greedy(llm, PROMPT, sampling) == transformers_greedy(model, PROMPT, repetition_penalty=penalty)
    model.generation_config.repetition_penalty = None
    early_eos(model)
    model.generation_config.min_new_tokens = 6
    no_minimum = SamplingParams(max_new_tokens=NEW_TOKENS, min_tokens=0)
    assert tierkv_greedy(llm, PROMPT, no_minimum) == transformers_greedy(model, PROMPT, min_new_tokens=0)
    three = SamplingParams(max_new_tokens=NEW_TOKENS, min_tokens=3)
    assert tierkv_greedy(llm, PROMPT, three) == transformers_greedy(model, PROMPT, min_new_tokens=3)


def test_min_tokens_holds_back_stop_token_ids_too(model, llm):
    stop = transformers_greedy(model, PROMPT)[1]
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=[stop], min_tokens=4)
    (out,) = llm.generate([PROMPT], sampling)
    assert stop not in out.token_ids[:4]
    assert out.token_ids == transformers_greedy(model, PROMPT, eos_token_id=stop, min_new_tokens=4)


def test_vllm_sampling_params_carry_repetition_penalty_and_min_tokens(model, llm):
    vllm = pytest.importorskip("vllm")
    early_eos(model)
    theirs = vllm.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, repetition_penalty=1.3, min_tokens=4)
    assert (SamplingParams.coerce(theirs).repetition_penalty, SamplingParams.coerce(theirs).min_tokens) == (1.3, 4)
    assert llm.generate([PROMPT], theirs)[0].token_ids == transformers_greedy(model, PROMPT, repetition_penalty=1.3,
                                                                              min_new_tokens=4)


def test_a_generation_config_edited_between_calls_is_honoured(model, llm):
    plain = transformers_greedy(model, PROMPT)
    assert tierkv_greedy(llm, PROMPT) == plain
    model.generation_config.repetition_penalty = 1.5
    assert tierkv_greedy(llm, PROMPT) == transformers_greedy(model, PROMPT) != plain
    model.generation_config.repetition_penalty = 1.0
    assert tierkv_greedy(llm, PROMPT) == plain


REFUSED = [  # field, a value transformers' greedy decoding would apply, the value that turns it off
    ("num_beams", 2, 1),
    ("force_words_ids", [[5]], None), ("penalty_alpha", 0.6, None), ("dola_layers", "high", None),
    ("guidance_scale", 1.5, None), ("sequence_bias", [[[5], -3.0]], None), ("encoder_repetition_penalty", 1.2, 1.0),
    ("no_repeat_ngram_size", 2, 0), ("encoder_no_repeat_ngram_size", 2, 0), ("bad_words_ids", [[5]], None),
    ("forced_bos_token_id", 0, None), ("forced_eos_token_id", 7, None),
    ("exponential_decay_length_penalty", (2, 1.5), None), ("suppress_tokens", [5, 6], None),
    ("begin_suppress_tokens", [5], None), ("watermarking_config", {"greenlist_ratio": 0.25}, None),
    ("stop_strings", ["\n"], None), ("token_healing", True, False),
    ("cache_implementation", "quantized", None),  # transformers would quantize its KV cache; tierkv's stays exact
]


@pytest.mark.parametrize("name,value,off", REFUSED)
def test_settings_tierkv_does_not_implement_are_refused_by_name(model, llm, name, value, off):
    setattr(model.generation_config, name, value)
    with pytest.raises(ValueError) as error:
        tierkv_greedy(llm, PROMPT)
    message = str(error.value)
    assert message.startswith(f"generation_config.{name}: got {value!r}")
    assert f"set model.generation_config.{name} = {off!r}" in message
    setattr(model.generation_config, name, off)
    assert tierkv_greedy(llm, PROMPT) == transformers_greedy(model, PROMPT)  # off: runs


def test_settings_that_cannot_change_greedy_tokens_are_not_refused(model, llm):
    """Sampling settings (not applied: tierkv stays greedy), renormalisation and lengths run as before; so do
    group-beam settings with one beam and a generous max_time (they were refused, though transformers 5's greedy
    tokens are the same with them)."""
    for name, value in (("do_sample", True), ("temperature", 0.3), ("top_k", 1), ("top_p", 0.5), ("min_p", 0.2),
                        ("typical_p", 0.5), ("renormalize_logits", True), ("max_length", 5), ("penalty_alpha", 0.6),
                        ("num_beams", 1), ("length_penalty", 2.0), ("remove_invalid_values", True),
                        ("num_beam_groups", 2), ("diversity_penalty", 0.5), ("max_time", 100.0),
                        ("cache_implementation", "dynamic")):
        setattr(model.generation_config, name, value)  # penalty_alpha with top_k 1: not contrastive search
    assert tierkv_greedy(llm, PROMPT) == transformers_greedy(model, PROMPT)


@pytest.mark.parametrize("min_new, min_length", [(0, len(PROMPT) + 6), (1, len(PROMPT) + 6), (None, len(PROMPT) + 3)])
def test_min_new_tokens_given_wins_over_min_length_as_in_transformers(model, llm, min_new, min_length):
    """transformers ignores min_length once min_new_tokens is set (0 too); tierkv held EOS back for the larger of
    the two, so a checkpoint setting both gave other tokens without a word (found by a probe)."""
    stop = transformers_greedy(model, PROMPT)[1]  # the model's second greedy token stands in for its EOS
    model.generation_config.eos_token_id = stop
    model.generation_config.min_new_tokens, model.generation_config.min_length = min_new, min_length
    assert tierkv_greedy(llm, PROMPT) == transformers_greedy(model, PROMPT)


def test_a_huge_integer_penalty_is_a_value_error_naming_the_field(model, llm):
    """10**400 made math.isfinite raise a bare OverflowError."""
    with pytest.raises(ValueError, match="^repetition_penalty: got an integer of 401 digits"):
        SamplingParams(repetition_penalty=10**400)
    model.generation_config.repetition_penalty = 10**400
    with pytest.raises(ValueError, match="^generation_config.repetition_penalty: got an integer of 401 digits"):
        tierkv_greedy(llm, PROMPT)


@pytest.mark.parametrize("name,value,error", [("repetition_penalty", 0.0, ValueError),
                                              ("repetition_penalty", "x", TypeError),
                                              ("min_new_tokens", -1, ValueError), ("min_length", 2.5, TypeError)])
def test_bad_values_of_supported_settings_are_refused_by_name(model, llm, name, value, error):
    setattr(model.generation_config, name, value)
    with pytest.raises(error, match=f"^generation_config.{name}: got"):
        tierkv_greedy(llm, PROMPT)


@settings(max_examples=60, deadline=None)
@given(penalty=st.floats(0.1, 5.0), min_tokens=st.integers(0, 4), num_generated=st.integers(0, 4),
       ids=st.lists(st.integers(0, 40), min_size=1, max_size=12), eos=st.sets(st.integers(0, 40), max_size=3),
       seed=st.integers(0, 2**16))
def test_logits_rules_match_transformers_processors(penalty, min_tokens, num_generated, ids, eos, seed):
    """LogitsRules against transformers' RepetitionPenaltyLogitsProcessor and MinNewTokensLengthLogitsProcessor;
    logits in bfloat16 are scored in float32, as transformers does."""
    logits = (torch.randn(32, generator=torch.Generator().manual_seed(seed)) * 3).bfloat16()  # ids >= 32: not scored
    num_generated = min(num_generated, len(ids))
    prompt, generated = ids[:len(ids) - num_generated], ids[len(ids) - num_generated:]
    rules = LogitsRules(penalty, min_tokens, prompt, eos)
    want = logits.float()[None]
    input_ids = torch.tensor([ids])
    if penalty != 1.0:
        want = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, want)
    if eos:
        want = MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, torch.tensor(sorted(eos)))(input_ids, want)
    assert torch.equal(rules.apply(logits, generated).float(), want[0])
