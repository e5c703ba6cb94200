"""The request totals and metrics set-up both front ends share (`tierkv.llm_totals`): sums match
the requests recorded, a bad record changes nothing, reading changes nothing, and a metrics service
that cannot start closes what the front end started; the vLLM front end counts through it."""
from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import pytest
from hypothesis import given, strategies as st

from tests.metrics.test_prometheus import free_port
from tests.vllm_engine_fake import FakeEngineBase, engine_namespace
from tierkv.config import ConfigError, load_config
from tierkv.llm_totals import RequestTotals, start_metrics

KEYS = ("prompt_tokens", "generated_tokens", "prefill_s")

requests = st.lists(st.fixed_dictionaries({"prompt_tokens": st.integers(0, 10**6),
                                           "generated_tokens": st.integers(0, 10**4),
                                           "prefill_s": st.floats(0, 100, allow_nan=False)}), max_size=20)


@given(requests, st.lists(st.floats(0, 10, allow_nan=False), max_size=5))
def test_the_totals_are_the_sums_of_what_was_recorded(recorded, walls):
    totals = RequestTotals(KEYS, per_call=("wall_s",))
    lines = []
    metrics = SimpleNamespace(record_request=lines.append)
    for stats in recorded:
        totals.record(stats, metrics)
    for wall_s in walls:
        totals.add("wall_s", wall_s)
    got = totals.as_dict()
    assert list(got) == ["requests", *KEYS, "wall_s"]
    assert got["requests"] == len(recorded) and lines == recorded
    for key in KEYS:
        assert got[key] == pytest.approx(sum(s[key] for s in recorded))
    assert got["wall_s"] == pytest.approx(sum(walls))
    assert isinstance(got["prefill_s"], float) and isinstance(got["wall_s"], float)
    got["requests"] = -1  # a copy: reading changes nothing
    assert totals.as_dict()["requests"] == len(recorded)


def test_a_record_that_lacks_a_summed_key_changes_nothing_and_names_it():
    totals = RequestTotals(KEYS)
    lines = []
    with pytest.raises(KeyError, match="generated_tokens, prefill_s"):
        totals.record({"prompt_tokens": 5}, SimpleNamespace(record_request=lines.append))
    assert totals.as_dict() == {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "prefill_s": 0.0}
    assert lines == []


def test_only_per_call_totals_are_added_directly_and_no_key_is_named_twice():
    totals = RequestTotals(KEYS, per_call=("wall_s",))
    for key in ("requests", "prompt_tokens", "decode_s"):
        with pytest.raises(KeyError, match="not a per-call total .*wall_s"):
            totals.add(key, 1)
    with pytest.raises(ValueError, match="named twice"):
        RequestTotals(("prompt_tokens", "prompt_tokens"))
    with pytest.raises(ValueError, match="named twice"):
        RequestTotals(("requests",))


def test_the_metrics_get_their_own_view_of_a_request_when_given_one():
    totals, lines = RequestTotals(("prompt_tokens",)), []
    totals.record({"prompt_tokens": 3, "top2": [1]}, SimpleNamespace(record_request=lines.append), {"prompt_tokens": 3})
    assert lines == [{"prompt_tokens": 3}] and totals.as_dict()["prompt_tokens"] == 3


def test_metrics_that_cannot_start_close_what_the_front_end_started(monkeypatch):
    monkeypatch.delenv("TIERKV_CONTROL_TOKEN", raising=False)
    config = load_config({"metrics": {"prometheus_port": free_port(), "control_enabled": True}}, env={})
    closed = []
    with pytest.raises(ConfigError, match="needs a token"):
        start_metrics(config, lambda: {}, on_failure=lambda: closed.append(True), set_gpu_budget=lambda b: None)
    assert closed == [True]
    service = start_metrics(load_config({"metrics": {"enabled": False}}, env={}), lambda: {},
                            on_failure=lambda: closed.append(True))
    assert service.recorder is None and closed == [True]


def _checkpoint(tmp_path) -> str:
    import json

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2, "hidden_size": 64,
                                                      "max_position_embeddings": 4096}))
    return str(tmp_path)


def _fake_vllm(monkeypatch, outputs):
    """vllm.LLM replaced by what VllmTieredLLM reads of it; `outputs` is what generate returns."""
    import vllm

    shut, sent = [], []

    class FakeLLM(FakeEngineBase):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.llm_engine = engine_namespace(kwargs, shutdown=lambda: shut.append(True), engine_id="fake")

        def generate(self, inputs, params, use_tqdm):
            sent.append(params)
            return outputs

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_V2_MODEL_RUNNER"):
        monkeypatch.setenv(name, "0")
    FakeLLM.sent = sent  # the vLLM SamplingParams of each generate call
    return shut


def _output(request_id: str, prompt: list[int], tokens: list[int], cached: int):
    logprobs = [{t: SimpleNamespace(logprob=-0.1), t + 1: SimpleNamespace(logprob=-2.0)} for t in tokens]
    completion = SimpleNamespace(token_ids=tokens, logprobs=logprobs, text="x", finish_reason="length")
    return SimpleNamespace(prompt_token_ids=prompt, outputs=[completion], num_cached_tokens=cached,
                           request_id=request_id, prompt=None)


def test_the_vllm_front_end_counts_requests_and_tells_the_metrics_without_the_logprobs(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from tierkv.integrations.vllm.llm import VllmTieredLLM

    _fake_vllm(monkeypatch, [_output("a", [1, 2, 3], [4, 5], 2), _output("b", [6] * 10, [7], 0)])
    llm = VllmTieredLLM(_checkpoint(tmp_path), {"cache": {"block_tokens": 16}}, hot_window=False)
    try:
        outs = llm.generate([[1, 2, 3], [6] * 10], max_new_tokens=2)
        totals = llm.stats()["requests"]
        assert list(totals) == ["requests", "prompt_tokens", "generated_tokens", "prefix_tokens", "wall_s"]
        assert [totals[k] for k in ("requests", "prompt_tokens", "generated_tokens", "prefix_tokens")] == [2, 13, 3, 2]
        assert totals["wall_s"] == outs[0].stats["batch_wall_s"] > 0
        assert outs[0].stats["top2_margins"] == [pytest.approx(1.9)] * 2
        lines = llm.metrics.recorder.lines_since(0)[0]
        recorded = [line["request"] for line in lines if line["kind"] == "request"]
        assert [(r["prompt_tokens"], r["prefix_tokens"]) for r in recorded] == [(3, 2), (10, 0)]
        assert not any(key.startswith("top2") for r in recorded for key in r)
    finally:
        llm.close()


def test_vllm_metrics_that_cannot_start_shut_the_engine_and_leave_no_config_file(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from tierkv.integrations.vllm.llm import VllmTieredLLM

    monkeypatch.delenv("TIERKV_CONTROL_TOKEN", raising=False)
    shut = _fake_vllm(monkeypatch, [])
    written = set(os.listdir(tempfile.gettempdir()))
    config = {"cache": {"block_tokens": 16}, "metrics": {"prometheus_port": free_port(), "control_enabled": True}}
    with pytest.raises(ConfigError, match="needs a token"):
        VllmTieredLLM(_checkpoint(tmp_path), config, hot_window=True)
    assert shut == [True]
    assert not {f for f in set(os.listdir(tempfile.gettempdir())) - written if f.startswith("tierkv-vllm-")}


def test_the_vllm_front_end_passes_repetition_penalty_and_min_tokens_or_the_checkpoints(tmp_path, monkeypatch):
    """Given, they reach vLLM's SamplingParams (they were dropped without a word); left at None, the
    checkpoint's generation_config values as vLLM reads them (get_diff_sampling_param)."""
    pytest.importorskip("vllm")
    import vllm

    from tierkv.integrations.vllm.llm import VllmTieredLLM
    from tierkv.sampling import SamplingParams

    _fake_vllm(monkeypatch, [_output("a", [1, 2, 3], [4, 5], 0)])
    llm = VllmTieredLLM(_checkpoint(tmp_path), {"cache": {"block_tokens": 16}}, hot_window=False)
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, repetition_penalty=1.3, min_tokens=2))
        llm.engine.llm_engine.model_config = SimpleNamespace(get_diff_sampling_param=lambda: {"repetition_penalty": 1.05},
                                                             get_vocab_size=lambda: 1000)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, repetition_penalty=1.0))
        sent = vllm.LLM.sent
        assert [(p.repetition_penalty, p.min_tokens) for p in sent] == [(1.3, 2), (1.05, 0), (1.0, 0)]
    finally:
        llm.close()


def test_a_vllm_front_end_never_closed_leaves_no_config_file(tmp_path, monkeypatch):
    """The YAML written for the connector goes when the TieredLLM is collected without a close, and at the
    interpreter's exit (a script that never closes it); close still removes it at once."""
    pytest.importorskip("vllm")
    import gc
    import subprocess
    import sys

    from tierkv.integrations.vllm.llm import VllmTieredLLM

    _fake_vllm(monkeypatch, [])
    llm = VllmTieredLLM(_checkpoint(tmp_path), {"cache": {"block_tokens": 16}}, hot_window=False)
    path = llm.config_file
    assert os.path.exists(path) and os.path.basename(path).startswith("tierkv-vllm-")
    del llm
    gc.collect()
    assert not os.path.exists(path)

    script = (
        "import pathlib, sys, pytest, tests.test_llm_totals as t\n"
        "from tierkv.integrations.vllm.llm import VllmTieredLLM\n"
        "t._fake_vllm(pytest.MonkeyPatch(), [])\n"
        "llm = VllmTieredLLM(t._checkpoint(pathlib.Path(sys.argv[1])), {'cache': {'block_tokens': 16}}, hot_window=False)\n"
        "print(llm.config_file)\n"  # never closed: the interpreter exits holding it
    )
    (tmp_path / "second").mkdir()
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "second")], capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-2000:]
    written = done.stdout.strip().splitlines()[-1]
    assert os.path.basename(written).startswith("tierkv-vllm-") and not os.path.exists(written)
