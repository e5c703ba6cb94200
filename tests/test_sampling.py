"""vLLM's conventions: `max_tokens`, vLLM's own SamplingParams, `out.outputs[0].text`, stops."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.test_llm import make_llm
from tierkv.sampling import RequestOutput, SamplingParams


def test_max_tokens_is_vllms_spelling_of_max_new_tokens():
    assert SamplingParams(max_tokens=7).max_new_tokens == 7
    with pytest.raises(ValueError, match="max_tokens=7 and max_new_tokens=3"):
        SamplingParams(max_tokens=7, max_new_tokens=3)
    with pytest.raises(ValueError, match="^max_tokens: got 0"):  # the error names the spelling the caller used
        SamplingParams(max_tokens=0)


def test_vllm_sampling_params_are_translated_or_refused_by_name():
    vllm = pytest.importorskip("vllm")
    ours = SamplingParams.coerce(vllm.SamplingParams(max_tokens=9, temperature=0.5, top_k=20, top_p=0.9, seed=4,
                                                     stop_token_ids=[3], ignore_eos=True))
    assert ours == SamplingParams(max_new_tokens=9, temperature=0.5, top_k=20, top_p=0.9, seed=4,
                                  stop_token_ids=[3], ignore_eos=True, repetition_penalty=1.0, min_tokens=0)
    plain = SamplingParams.coerce(vllm.SamplingParams(max_tokens=4, temperature=0))
    assert (plain.top_k, plain.top_p, plain.stop_token_ids) == (None, None, None)
    with pytest.raises(ValueError, match="sampling.n: got 2"):
        SamplingParams.coerce(vllm.SamplingParams(n=2))
    with pytest.raises(ValueError, match="sampling.presence_penalty"):
        SamplingParams.coerce(vllm.SamplingParams(presence_penalty=0.5))
    # carried as given (vLLM's 1.0 and 0 too: explicit settings override the model's generation_config)
    carried = SamplingParams.coerce(vllm.SamplingParams(max_tokens=6, repetition_penalty=1.2, min_tokens=3))
    assert (carried.repetition_penalty, carried.min_tokens) == (1.2, 3)
    with pytest.raises(ValueError, match="sampling.detokenize: got False"):  # tierkv always returns the text
        SamplingParams.coerce(vllm.SamplingParams(max_tokens=3, detokenize=False))
    with pytest.raises(TypeError, match="expected tierkv.sampling.SamplingParams or vllm.SamplingParams"):
        SamplingParams.coerce({"max_tokens": 3})
    for given in (dict(logit_bias={3: 1.0}), dict(allowed_token_ids=[1, 2]), dict(bad_words=["x"]),
                  dict(skip_special_tokens=False), dict(include_stop_str_in_output=True)):  # never silently dropped
        name = next(iter(given))
        with pytest.raises(ValueError, match=f"sampling.{name}: got"):
            SamplingParams.coerce(vllm.SamplingParams(max_tokens=4, **given))
    assert SamplingParams.coerce(vllm.SamplingParams(max_tokens=4, logit_bias={})) == SamplingParams(
        max_new_tokens=4, temperature=1.0, repetition_penalty=1.0, min_tokens=0)


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(["max_new_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos", "stop_token_ids",
                             "repetition_penalty", "min_tokens"]),
       value=st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(allow_nan=True),
                       st.text(max_size=4), st.lists(st.integers(-3, 3), max_size=3)))
def test_any_setting_is_accepted_or_refused_with_its_name(name, value):
    try:
        params = SamplingParams(**{name: value})
    except (TypeError, ValueError) as error:
        assert str(error).startswith(name), error
        return
    # accepted: a value the sampler can use
    assert params.max_new_tokens >= 1 and math.isfinite(params.temperature) and params.temperature >= 0
    assert params.top_k is None or params.top_k >= 1
    assert params.top_p is None or 0 < params.top_p <= 1
    assert params.stop_token_ids is None or all(isinstance(t, int) and t >= 0 for t in params.stop_token_ids)
    assert isinstance(params.ignore_eos, bool)
    penalty = params.repetition_penalty
    assert penalty is None or (math.isfinite(penalty) and penalty > 0)
    assert params.min_tokens is None or 0 <= params.min_tokens <= params.max_new_tokens


def test_repetition_penalty_and_min_tokens_default_to_the_models_and_are_checked():
    assert (SamplingParams().repetition_penalty, SamplingParams().min_tokens) == (None, None)  # generation_config's
    with pytest.raises(ValueError, match=r"^min_tokens: got 5; must be <= max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match=r"^min_tokens: got 5; must be <= max_new_tokens \(4\)"):
        SamplingParams(max_new_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="^repetition_penalty: got 0"):
        SamplingParams(repetition_penalty=0)
    params = SamplingParams(max_new_tokens=4, min_tokens=2)
    params.min_tokens = 9  # set after construction: checked when a request takes it
    with pytest.raises(ValueError, match="^min_tokens: got 9"):
        SamplingParams.coerce(params)


def test_outputs_have_vllms_shape_and_stops_follow_vllm(tmp_path):
    llm, _ = make_llm(tmp_path)
    prompt = torch.randint(0, 512, (30,)).tolist()
    with llm:
        (free,) = llm.generate([prompt], max_tokens=6)
        assert isinstance(free, RequestOutput) and free.finished
        assert free.outputs[0].token_ids == free.token_ids and free.outputs[0].finish_reason == "length"
        # a stop token besides EOS ends the request at its first occurrence, token included
        stop = free.token_ids[2]
        (stopped,) = llm.generate([prompt], max_tokens=6, stop_token_ids=[stop])
        first = free.token_ids.index(stop)
        assert stopped.token_ids == free.token_ids[:first + 1] and stopped.outputs[0].finish_reason == "stop"


def test_settings_past_what_sampling_can_take_are_refused_by_name():
    import pytest

    from tierkv.sampling import SamplingParams

    with pytest.raises(ValueError, match=r"seed: got 18446744073709551616; must be in \[0, 18446744073709551615\]"):
        SamplingParams(seed=2**64)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams().max_new_tokens == 64 and SamplingParams(max_tokens=3).max_new_tokens == 3


def test_a_near_zero_temperature_samples_the_top_token():
    import torch

    from tierkv.sampling import SamplingParams, sample_next

    logits = torch.tensor([1.0, 3.0, 2.5, -1e4])
    for temperature in (1e-39, 1e-300, 1e-20):
        params = SamplingParams(temperature=temperature, seed=0)
        assert sample_next(logits, params, torch.Generator().manual_seed(0)) == 1


def test_max_tokens_beside_any_explicit_max_new_tokens_is_refused_unless_equal():
    """An explicit max_new_tokens=64 (the default's value) beside max_tokens=3 gave 3 tokens without a word
    (found by a real-model probe): only an equal pair, or one of them alone, is taken."""
    from tierkv.sampling import SamplingParams, sampling_from_kwargs

    with pytest.raises(ValueError, match="max_tokens=3 and max_new_tokens=64: give one"):
        SamplingParams(max_tokens=3, max_new_tokens=64)
    with pytest.raises(ValueError, match="give one"):
        sampling_from_kwargs({"max_tokens": 3, "max_new_tokens": 64})
    assert SamplingParams(max_tokens=3, max_new_tokens=3).max_new_tokens == 3
    assert SamplingParams(max_tokens=3).max_new_tokens == SamplingParams(max_new_tokens=3).max_new_tokens == 3
    assert SamplingParams().max_new_tokens == 64
