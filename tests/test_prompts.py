"""Prompts in every form users hand over (lists, numpy integers, tensors, arrays, a tokenizer's
output) give the tokens of the same ids as a list; bad ones are refused naming request and token,
before any work, and the next good request still gives correct tokens. Also the other entry
points' arguments: SamplingParams, TieredLLM, runtime_for_model, TieredCache."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.models import build, reference_greedy
from tierkv.config import load_config
from tierkv.llm import TieredLLM
from tierkv.prompts import PromptError, normalize_prompts, token_ids
from tierkv.sampling import SamplingParams

VOCAB = 512
BLOCK_BYTES = 2 * 2 * 4 * 16 * 4


def settings_dict(tmp_path) -> dict:
    return {
        "model": {"name": "prompt-test"},
        "cache": {"block_tokens": 4, "gpu_budget_bytes": 2 * 6 * BLOCK_BYTES, "sink_tokens": 4, "window_tokens": 8},
        "tiers": [{"kind": "cpu", "capacity_bytes": 4096 * BLOCK_BYTES}],
        "scheduler": {"lookahead_layers": 1, "staging_bytes": 2 * 4 * BLOCK_BYTES, "prefill_chunk_tokens": 64},
    }


@pytest.fixture(scope="module")
def llm_and_reference(tmp_path_factory):
    model, reference = build("llama", seed=11)
    llm = TieredLLM(model, load_config(settings_dict(tmp_path_factory.mktemp("p")), env={}), show_progress=False)
    yield llm, reference
    llm.close()


# -- the normaliser, fuzzed -------------------------------------------------------------------------
ids_lists = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)
int_dtypes = st.sampled_from([np.int64, np.int32, np.int16, np.uint16, np.uint8])


def as_form(ids: list[int], form: str, dtype):
    small = dtype(0).itemsize >= 2 or max(ids) < 256
    if form == "list":
        return list(ids)
    if form == "tuple":
        return tuple(ids)
    if form == "numpy_ints":
        return [np.int64(t) for t in ids]
    if form == "array":
        return np.asarray(ids, dtype=dtype if small else np.int64)
    if form == "tensor":
        return torch.tensor(ids, dtype=torch.int32 if small else torch.int64)
    return [torch.tensor(t) for t in ids]  # 0-d tensors


forms = st.sampled_from(["list", "tuple", "numpy_ints", "array", "tensor", "tensor_items"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(ids_lists, forms, int_dtypes), min_size=1, max_size=4), st.booleans())
def test_every_accepted_form_gives_the_same_ids(prompts, single):
    if single:
        ids, form, dtype = prompts[0]
        assert normalize_prompts(as_form(ids, form, dtype), vocab_size=VOCAB) == [ids]
    else:
        batch = [as_form(ids, form, dtype) for ids, form, dtype in prompts]
        got = normalize_prompts(batch, vocab_size=VOCAB)
        assert got == [ids for ids, _, _ in prompts] and all(type(t) is int for row in got for t in row)


@settings(max_examples=100, deadline=None)
@given(st.lists(ids_lists.filter(lambda x: len(x) >= 3), min_size=1, max_size=3), st.data())
def test_2d_tensors_and_tokenizer_outputs_are_batches_with_padding_dropped(rows, data):
    width = max(len(r) for r in rows)
    left = data.draw(st.booleans())
    pad = lambda r, v: ([v] * (width - len(r)) + r) if left else (r + [v] * (width - len(r)))  # noqa: E731
    ids = torch.tensor([pad(r, 0) for r in rows])
    mask = torch.tensor([pad([1] * len(r), 0) for r in rows])
    assert normalize_prompts({"input_ids": ids, "attention_mask": mask}, vocab_size=VOCAB) == rows
    from transformers import BatchEncoding

    encoding = BatchEncoding({"input_ids": [pad(r, 0) for r in rows], "attention_mask": mask.tolist()})
    assert normalize_prompts(encoding, vocab_size=VOCAB) == rows
    if all(len(r) == width for r in rows):
        assert normalize_prompts(ids.numpy(), vocab_size=VOCAB) == rows


bad_tokens = st.one_of(st.integers(max_value=-1), st.integers(min_value=VOCAB), st.floats(allow_nan=True),
                       st.booleans(), st.text(max_size=3), st.none(), st.just(np.float32(1.0)), st.just(np.bool_(True)),
                       st.just(torch.tensor(1.0)), st.just(torch.tensor(True)), st.just(torch.tensor([1, 2])))


@settings(max_examples=300, deadline=None)
@given(ids_lists, bad_tokens, st.data())
def test_one_bad_token_anywhere_is_named_with_its_request_and_position(ids, bad, data):
    pos = data.draw(st.integers(0, len(ids)))
    prompt = ids[:pos] + [bad] + ids[pos:]
    if pos == 0 and isinstance(bad, (str, type(None))) or (pos == 0 and isinstance(bad, torch.Tensor) and bad.ndim == 1):
        # not a token-like first element: the list reads as a batch, whose int entries are no prompts
        with pytest.raises(PromptError, match=r"request \d+: "):
            normalize_prompts(prompt, vocab_size=VOCAB)
        return
    with pytest.raises(PromptError, match=rf"request 0: token {pos} is "):
        normalize_prompts(prompt, vocab_size=VOCAB)
    with pytest.raises(PromptError, match=rf"request 1: token {pos} is "):
        normalize_prompts([ids, prompt], vocab_size=VOCAB)


@pytest.mark.parametrize("prompts,message", [
    (None, "prompts: got NoneType"), (b"ab", "prompts: got bytes"), ([], "got an empty list"), ([[]], "request 0: the prompt is empty"),
    ("", "request 0: the prompt is empty"), (torch.tensor(3), "0-D Tensor"), (torch.zeros(2, 2, 2, dtype=torch.long), "3-D Tensor"),
    (torch.tensor([1.0, 2.0]), "dtype torch.float32"), (torch.tensor([True]), "dtype torch.bool"),
    (np.array([1.5]), "dtype float64"), (np.array(["1"]), "dtype <U1"), (torch.zeros(0, 3, dtype=torch.long), "a batch of 0"),
    (torch.tensor([], dtype=torch.long), "the prompt is empty"), ([torch.zeros(2, 2, dtype=torch.long)], "request 0: got a 2-D"),
    ({"ids": [1]}, "without 'input_ids'"), ({"input_ids": [[1, 2]], "attention_mask": [[1]]}, "attention_mask must be"),
    ({"input_ids": [[1, 2]], "attention_mask": [[1, 1], [1, 1]]}, "2 rows for 1 rows"), (3, "prompts: got int"),
    (np.array([2**64 - 1], dtype=np.uint64), "token 0 is 18446744073709551615"), ([1, 2**70], "token 1 is 1180591620717411303424"),
    ({1, 2}, "prompts: got set"),
    ({"input_ids": [1, 2], "attention_mask": 5}, "prompts['attention_mask']: got 5"),
    ({"input_ids": [1, 2], "attention_mask": [None, 1]}, "attention_mask must be 0s and 1s"),
    (torch.tensor([1, 2], device="meta"), "a tensor on the meta device"),
    (np.array([2**64 - 1], dtype=np.uint64), f"token ids are ints in [0, {VOCAB})"),
    (torch.tensor([1, 2**64 - 1], dtype=torch.uint64), "token 1 is 18446744073709551615"),  # not a wrapped -1
])
def test_bad_prompt_forms_are_refused_by_name(prompts, message):
    with pytest.raises(PromptError, match=re.escape(message)):
        normalize_prompts(prompts, vocab_size=VOCAB)
    assert issubclass(PromptError, ValueError) and issubclass(PromptError, TypeError)


def test_text_is_refused_only_where_no_tokenizer_reads_it():
    assert normalize_prompts(["a", [1]], vocab_size=VOCAB) == ["a", [1]]
    with pytest.raises(PromptError, match="request 1: no tokenizer"):
        normalize_prompts([[1], "a"], vocab_size=VOCAB, text_error="no tokenizer")
    assert token_ids(torch.tensor([5, 2**40]), vocab_size=None) == [5, 2**40]


# -- TieredLLM ------------------------------------------------------------------------------------------
def test_tensor_numpy_and_tokenizer_prompts_give_the_tokens_of_the_same_ids(llm_and_reference):
    from transformers import BatchEncoding

    llm, reference = llm_and_reference
    a = torch.randint(0, VOCAB, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    b = torch.randint(0, VOCAB, (29,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = [reference_greedy(reference, p, 4)[0] for p in (a, b)]
    forms = [torch.tensor([a, b]), np.array([a, b], dtype=np.int32), [np.asarray(a), torch.tensor(b)],
             [[np.int64(t) for t in a], b], BatchEncoding({"input_ids": torch.tensor([a, b]),
                                                           "attention_mask": torch.ones(2, 29, dtype=torch.long)})]
    for prompts in forms:
        outs = llm.generate(prompts, max_new_tokens=4)
        assert [o.token_ids for o in outs] == expected and [o.prompt_token_ids for o in outs] == [a, b]
    (one,) = llm.generate(torch.tensor(a), max_new_tokens=4)
    assert one.token_ids == expected[0]


@pytest.mark.parametrize("prompts,error,message", [
    ([[1, 2], [3, VOCAB]], PromptError, "request 1: token 1 is 512; token ids are ints in [0, 512)"),
    (torch.tensor([[1, -1]]), PromptError, "request 0: token 1 is -1"),
    (torch.tensor([1.0]), PromptError, "dtype torch.float32"),
    (np.array([[[1]]]), PromptError, "3-D ndarray"),
    ([[1, 2], "text"], PromptError, "request 1: a text prompt needs a tokenizer"),
    (None, PromptError, "prompts: got NoneType"),
])
def test_bad_prompts_are_refused_before_any_work_and_the_runtime_keeps_working(llm_and_reference, prompts, error, message):
    llm, reference = llm_and_reference
    before = llm.stats()["requests"]["requests"]
    with pytest.raises(error, match=re.escape(message)):
        llm.generate(prompts, max_new_tokens=3)
    assert llm.stats()["requests"]["requests"] == before  # nothing ran, not even the good first request
    good = torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    (out,) = llm.generate([good], max_new_tokens=3)
    assert out.token_ids == reference_greedy(reference, good, 3)[0]


@pytest.mark.parametrize("kwargs,error,message", [
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens: got 0"), ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens: got 2.5"),
    ({"max_new_tokens": True}, TypeError, "max_new_tokens: got True"), ({"temperature": float("nan")}, ValueError, "temperature: got nan"),
    ({"temperature": -1}, ValueError, "temperature: got -1"), ({"temperature": "0.5"}, TypeError, "temperature: got '0.5'"),
    ({"top_k": 0}, ValueError, "top_k: got 0"), ({"top_p": float("inf")}, ValueError, "top_p: got inf"),
    ({"top_p": 0}, ValueError, "top_p: got 0"), ({"seed": "x"}, TypeError, "seed: got 'x'"),
    ({"stop_token_ids": 2}, TypeError, "stop_token_ids: got 2"), ({"stop_token_ids": [1, -2]}, ValueError, r"stop_token_ids\[1\]"),
    ({"ignore_eos": "no"}, TypeError, "ignore_eos: got 'no'"), ({"max_token": 3}, TypeError, "unknown sampling setting.*max_token"),
])
def test_bad_sampling_settings_are_named_and_the_runtime_keeps_working(llm_and_reference, kwargs, error, message):
    llm, reference = llm_and_reference
    prompt = [5, 6, 7, 8, 9]
    with pytest.raises(error, match=message):
        llm.generate([prompt], **kwargs)
    if "max_token" not in kwargs:  # an unknown keyword: refused by generate(); SamplingParams(**) is a plain TypeError
        with pytest.raises(error, match=message):
            SamplingParams(**kwargs)
    with pytest.raises(TypeError, match="sampling: got dict"):
        llm.generate([prompt], {"max_new_tokens": 2})
    (out,) = llm.generate([prompt], SamplingParams(max_new_tokens=2, stop_token_ids=[np.int64(VOCAB - 1)]))
    assert out.token_ids == reference_greedy(reference, prompt, 2)[0]


@settings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.one_of(st.integers(-3, 5), st.floats(), st.booleans(), st.none()),
    "temperature": st.one_of(st.floats(), st.integers(-2, 2), st.text(max_size=2)),
    "top_k": st.one_of(st.none(), st.integers(-2, 5), st.floats()),
    "top_p": st.one_of(st.none(), st.floats()),
    "seed": st.one_of(st.none(), st.integers(-3, 3), st.floats())}))
def test_sampling_params_accept_exactly_the_valid_space(kwargs):
    import math

    def valid(k, v):
        is_int = isinstance(v, int) and not isinstance(v, bool)
        is_real = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        return {"max_new_tokens": v is None or (is_int and v >= 1), "temperature": is_real and v >= 0,
                "top_k": v is None or (is_int and v >= 1), "top_p": v is None or (is_real and 0 < v <= 1),
                "seed": v is None or (is_int and v >= 0)}[k]

    if all(valid(k, v) for k, v in kwargs.items()):
        SamplingParams(**kwargs)
    else:
        bad = next(k for k in ("max_new_tokens", "temperature", "top_k", "top_p", "seed") if k in kwargs and not valid(k, kwargs[k]))
        with pytest.raises((TypeError, ValueError), match=bad):
            SamplingParams(**kwargs)


# -- constructor, adapter ---------------------------------------------------------------------------------
def test_constructor_and_adapter_arguments_are_named(tmp_path, llm_and_reference):
    from tierkv.integrations.hf import TieredCache, runtime_for_model

    model, _ = build("llama", seed=12)
    config = load_config(settings_dict(tmp_path), env={})
    with pytest.raises(TypeError, match="config: got int"):
        TieredLLM(model, 5)
    with pytest.raises(ValueError, match="device: got 'gpu'"):
        TieredLLM(model, config, device="gpu")
    with pytest.raises(TypeError, match="tokenizer: got int"):
        TieredLLM(model, config, tokenizer=3)
    with pytest.raises(ValueError, match="model: got 'no-such-dir'"):
        TieredLLM("no-such-dir", config)
    with pytest.raises(TypeError, match="model: got str"):
        runtime_for_model("no-such-dir", config)
    with pytest.raises(TypeError, match="config: got dict"):
        runtime_for_model(model, settings_dict(tmp_path))
    with pytest.raises(TypeError, match="model_id: got int"):
        runtime_for_model(model, config, model_id=7)
    llm, reference = llm_and_reference
    with pytest.raises(TypeError, match="runtime: got str"):
        TieredCache("rt", [1, 2])
    for bad, message in ((torch.tensor([1.5]), "dtype torch.float32"), ([1, -2], "token 1 is -2"), (torch.tensor(4), "0-D")):
        with pytest.raises(PromptError, match=message):
            TieredCache(llm.runtime, bad)
    assert llm.runtime.active is None or llm.runtime.active.is_finished  # a refused cache holds no sequence
    (out,) = llm.generate([[1, 2, 3, 4, 5]], max_new_tokens=2)
    assert out.token_ids == reference_greedy(reference, [1, 2, 3, 4, 5], 2)[0]


def test_vllm_backend_checks_prompts_before_the_engine_sees_them():
    pytest.importorskip("vllm")  # CI installs it; the check itself needs only vLLM's SamplingParams class
    from types import SimpleNamespace

    from tierkv.integrations.vllm.llm import VllmTieredLLM
    from tierkv.llm_totals import RequestTotals

    seen = []
    llm = object.__new__(VllmTieredLLM)
    llm.totals = RequestTotals(("prompt_tokens",), per_call=("wall_s",))  # the fake engine returns no outputs
    llm.engine = SimpleNamespace(
        llm_engine=SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: VOCAB)),
        generate=lambda inputs, params, use_tqdm: seen.append(inputs) or [])
    assert llm.generate(torch.tensor([[1, 2], [3, 4]]), max_new_tokens=2) == []
    assert seen == [[{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3, 4]}]]
    llm.generate(["text", np.array([7, 8])], max_new_tokens=2)
    assert seen[-1] == ["text", {"prompt_token_ids": [7, 8]}]
    with pytest.raises(PromptError, match=r"request 1: token 0 is 512; token ids are ints in \[0, 512\)"):
        llm.generate([[1], [VOCAB]], max_new_tokens=2)
    assert len(seen) == 2


def test_text_with_a_lone_surrogate_is_refused_naming_where():
    import pytest

    from tierkv.prompts import PromptError, normalize_prompts

    with pytest.raises(PromptError, match=r"request 1: the text is not valid Unicode at character 1"):
        normalize_prompts(["fine", "a\ud800b"], vocab_size=10)


def test_the_warning_past_max_position_embeddings_reads_the_models_rope_scaling(caplog):
    from types import SimpleNamespace

    from tierkv.llm_inputs import warn_past_positions

    plain = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64, rope_scaling=None))
    scaled = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64,
                                                    rope_scaling={"rope_type": "dynamic", "factor": 4.0}))
    with caplog.at_level("WARNING"):
        warn_past_positions(plain, 0, 64)  # at the limit: nothing
        assert not caplog.records
        warn_past_positions(plain, 1, 65)
        warn_past_positions(scaled, 2, 65)
    first, second = (r.getMessage() for r in caplog.records)
    assert "request 1 runs the model at 65 positions" in first and "use a checkpoint with rope scaling" in first
    assert "request 2" in second and "rope scaling (dynamic)" in second and "use a checkpoint" not in second


def test_the_warning_counts_the_positions_the_model_runs_at_not_the_last_new_token(tmp_path, caplog):
    """The last new token is never fed back: a 63-token prompt with 2 new tokens runs positions 0..63 of a
    64-position model (no warning); 3 new tokens run 65 positions (a warning naming them)."""
    model, _ = build("llama", seed=3)
    model.config.max_position_embeddings = 64
    llm = TieredLLM(model, load_config(settings_dict(tmp_path), env={}), show_progress=False)
    try:
        prompt = list(range(5, 68))
        with caplog.at_level("WARNING", logger="tierkv"):
            llm.generate([prompt], max_tokens=2)
            assert not [r for r in caplog.records if "max_position_embeddings" in r.getMessage()]
            llm.generate([prompt], max_tokens=3)
        warned = [r.getMessage() for r in caplog.records if "max_position_embeddings=64" in r.getMessage()]
        assert len(warned) == 1 and "request 0 runs the model at 65 positions" in warned[0]
    finally:
        llm.close()
