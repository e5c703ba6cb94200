"""A GPU budget change that cannot be applied is refused: the old pool keeps working, the running
request's tokens do not change, and the refusal is raised to a waiting caller and counted."""
from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import tierkv.engine.elastic as elastic
import tierkv.llm as llm_module
from tests.models import build, reference_greedy
from tierkv.budget_change import BudgetRefused, HotWindowLost, parse_budget
from tierkv.config import ConfigError, load_config
from tierkv.llm import TieredLLM
from tierkv.metrics.snapshot import flatten_stats
from tierkv.storage.gpu import ResidencyPlan

BLOCK_BYTES = 2 * 2 * 4 * 16 * 4  # K+V, 2 kv heads, 4 tokens, head_dim 16, fp32
LAYERS = 2
SLOTS = 6        # slots per layer of the starting budget; sinks + window need 4
NEW_TOKENS = 12


def budget(slots: int) -> int:
    return LAYERS * slots * BLOCK_BYTES


@pytest.fixture(scope="module")
def model_and_expected():
    model, reference = build("llama", num_heads=8, num_kv_heads=2, seed=3)
    prompt = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    expected, _ = reference_greedy(reference, prompt, NEW_TOKENS)
    return model, prompt, expected


@pytest.fixture
def llm(model_and_expected):
    config = load_config({
        "cache": {"block_tokens": 4, "gpu_budget_bytes": budget(SLOTS), "sink_tokens": 4, "window_tokens": 8},
        "tiers": [{"kind": "cpu", "capacity_bytes": "16MiB"}],
        "scheduler": {"lookahead_layers": 1, "staging_bytes": 2 * 4 * BLOCK_BYTES, "prefill_chunk_tokens": 64},
        "metrics": {"enabled": True},
    }, env={})
    with TieredLLM(model_and_expected[0], config, show_progress=False) as tiered:
        yield tiered


def failing(monkeypatch, name: str, fail_slots: set[int], error: Exception) -> list[int]:
    """Make elastic.<name> (_allocate or _refill) raise `error` for pools of `fail_slots` slots per layer;
    returns the list of slot counts it was asked for."""
    real = getattr(elastic, name)
    asked = []

    def fake(*args):
        residency = next(a for a in args if isinstance(a, ResidencyPlan))
        asked.append(residency.slots_per_layer)
        if residency.slots_per_layer in fail_slots:
            raise error
        return real(*args)

    monkeypatch.setattr(elastic, name, fake)
    return asked


def change_during_decode(monkeypatch, llm, new_budget, *, wait: bool, at_token: int = 4) -> list:
    """Generate while `set_gpu_budget(new_budget, wait=wait)` arrives after `at_token` decode steps;
    returns (output tokens, what the caller got: None or the exception)."""
    real_sample = llm_module.sample_next
    calls, outcome = [], []

    def set_budget():
        try:
            llm.set_gpu_budget(new_budget, wait=wait, timeout_s=60)
            outcome.append(None)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    def sample(*args):
        calls.append(1)
        if len(calls) == at_token:
            if wait:  # a waiting caller on another thread: it returns once the next step applied the change
                threading.Thread(target=set_budget).start()
            else:
                set_budget()
        return real_sample(*args)

    monkeypatch.setattr(llm_module, "sample_next", sample)
    (out,) = llm.generate([PROMPT[0]], max_new_tokens=NEW_TOKENS)
    assert llm.runtime.wait_for_budget(60)
    for _ in range(600):  # the waiting caller's thread returns right after the change resolved
        if outcome:
            break
        threading.Event().wait(0.05)
    return out.token_ids, outcome


PROMPT: list = []


@pytest.fixture(autouse=True)
def _prompt(model_and_expected):
    PROMPT[:] = [model_and_expected[1]]


@pytest.mark.parametrize("name,fail_slots,new_slots,error,wait", [
    ("_allocate", {40}, 40, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 PiB"), True),  # grow
    ("_allocate", {40}, 40, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 PiB"), False),
    ("_allocate", {5}, 5, RuntimeError("allocator failed"), False),                                     # shrink
    ("_refill", {40}, 40, RuntimeError("gather failed"), True),                                       # grow, halfway
    ("_refill", {5}, 5, RuntimeError("gather failed"), False),              # shrink, halfway: old pool rebuilt
])
def test_a_change_that_fails_during_decode_is_refused_and_the_request_keeps_its_tokens(
        monkeypatch, llm, model_and_expected, wait, name, fail_slots, new_slots, error):
    expected = model_and_expected[2]
    asked = failing(monkeypatch, name, fail_slots, error)
    tokens, outcome = change_during_decode(monkeypatch, llm, budget(new_slots), wait=wait)
    assert tokens == expected
    assert new_slots in asked  # the change was tried, and failed
    assert llm.runtime.residency.slots_per_layer == SLOTS and llm.runtime.pool.resident.shape[1] == SLOTS
    gpu = llm.stats()["gpu"]
    assert gpu["budget_refusals"] == 1 and gpu["budget_changes"] == 0 and gpu["budget_bytes"] == budget(SLOTS)
    assert str(error) in gpu["last_budget_refusal"]
    if wait:
        assert isinstance(outcome[0], BudgetRefused) and str(error) in str(outcome[0])
    else:
        assert outcome == [None]  # not waiting: the refusal is logged and counted
    figures, _, info, _ = flatten_stats(llm.stats())
    assert figures["gpu.budget_refusals"] == 1 and str(error) in info["gpu.last_budget_refusal"]
    (again,) = llm.generate([model_and_expected[1]], max_new_tokens=NEW_TOKENS)  # the old pool still serves
    assert again.token_ids == expected


@pytest.mark.parametrize("wait", [True, False])
def test_an_allocation_failure_between_requests_is_refused(monkeypatch, llm, model_and_expected, wait, caplog):
    failing(monkeypatch, "_allocate", {40}, torch.OutOfMemoryError("out of memory"))
    if wait:
        with pytest.raises(BudgetRefused, match="out of memory.*stays"):
            llm.set_gpu_budget(budget(40))
    else:
        llm.set_gpu_budget(budget(40), wait=False)
    assert "GPU budget change refused" in caplog.text
    assert llm.stats()["gpu"]["budget_refusals"] == 1
    (out,) = llm.generate([model_and_expected[1]], max_new_tokens=NEW_TOKENS)
    assert out.token_ids == model_and_expected[2]
    llm.set_gpu_budget(budget(9))  # a change that fits still applies
    assert llm.runtime.residency.slots_per_layer == 9


def test_losing_the_pool_as_well_as_the_change_ends_the_request_with_a_clear_error(
        monkeypatch, llm, model_and_expected):
    failing(monkeypatch, "_allocate", {5, SLOTS}, RuntimeError("allocator failed"))
    with pytest.raises(HotWindowLost, match="rebuilding the old pool"):
        change_during_decode(monkeypatch, llm, budget(5), wait=False)
    assert llm.stats()["gpu"]["resident_bytes"] == 0
    monkeypatch.undo()  # the allocator works again: the next request rebuilds the pool at the old budget
    (out,) = llm.generate([model_and_expected[1]], max_new_tokens=NEW_TOKENS)
    assert out.token_ids == model_and_expected[2] and llm.runtime.residency.slots_per_layer == SLOTS


@pytest.mark.parametrize("wait", [True, False])
def test_a_budget_beyond_the_device_is_refused_at_once_during_decode(monkeypatch, llm, model_and_expected, wait):
    tokens, outcome = change_during_decode(monkeypatch, llm, 2**50, wait=wait)
    assert tokens == model_and_expected[2]
    assert isinstance(outcome[0], BudgetRefused) and "can give at most" in str(outcome[0])
    assert llm.stats()["gpu"]["budget_refusals"] == 1
    import tierkv.budget_change as budget_change  # a device with little free memory: the sizes decide

    monkeypatch.setattr(budget_change, "device_bytes_available", lambda device: budget(3))
    with pytest.raises(BudgetRefused, match="can give at most"):
        llm.set_gpu_budget(budget(SLOTS + 4), wait=False)
    llm.set_gpu_budget(budget(SLOTS + 3))  # fits: held + available
    assert llm.runtime.residency.slots_per_layer == SLOTS + 3


BAD_VALUES = [0, -1, -(2**60), "0", "0GiB", "-1GiB", "1 parsecs", "1.5B", "lots", "", "GiB", None, [], {}, True,
              False, math.nan, math.inf, -math.inf, "nan", "inf", 1.5, b"1GiB", object()]


@pytest.mark.parametrize("value", BAD_VALUES, ids=repr)
def test_bad_budget_values_are_refused_with_a_value_error_and_nothing_changes(llm, value):
    with pytest.raises(ValueError, match="budget"):
        llm.set_gpu_budget(value, wait=False)
    assert llm.runtime.residency.slots_per_layer == SLOTS
    assert llm.stats()["gpu"]["budget_refusals"] == 1


def test_a_budget_below_sinks_and_window_is_refused_with_the_sizes(llm):
    with pytest.raises(ConfigError, match=r"holds 3 blocks .* sinks \+ window need 4 per layer \(at least"):
        llm.set_gpu_budget(budget(3), wait=False)
    assert llm.runtime.residency.slots_per_layer == SLOTS


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True),
                       st.text(max_size=12), st.from_regex(r"-?[0-9]{1,20}(\.[0-9]{1,3})? ?[kKmMgGtTiIbB]{0,3}",
                                                           fullmatch=True)))
def test_any_budget_value_is_applied_or_refused_and_the_pool_stays_consistent(monkeypatch, llm, value):
    import tierkv.budget_change as budget_change  # a small device: no example allocates much

    monkeypatch.setattr(budget_change, "device_bytes_available", lambda device: budget(64))
    rt = llm.runtime
    before = rt.residency.slots_per_layer
    try:
        llm.set_gpu_budget(value)
    except (ValueError, BudgetRefused) as exc:  # ConfigError is a ValueError
        assert rt.residency.slots_per_layer == before, exc
    else:
        assert rt.config.cache.gpu_budget_bytes == parse_budget(value)
        assert rt.residency.slots_per_layer == rt.config.cache.gpu_budget_bytes // (LAYERS * BLOCK_BYTES)
    assert rt.pool.resident.shape[1] == rt.residency.slots_per_layer
    llm.set_gpu_budget(budget(SLOTS))  # back to the start for the next example


def test_reload_config_with_an_impossible_budget_changes_nothing(monkeypatch, llm):
    failing(monkeypatch, "_allocate", {40}, torch.OutOfMemoryError("out of memory"))
    config = llm.config
    data = {"model": vars(config.model), "cache": {**vars(config.cache), "gpu_budget_bytes": budget(40)},
            "tiers": [vars(t) for t in config.tiers], "scheduler": vars(config.scheduler), "metrics": vars(config.metrics)}
    with pytest.raises(BudgetRefused):
        llm.reload_config(data)
    assert llm.config.cache.gpu_budget_bytes == budget(SLOTS) and llm.runtime.residency.slots_per_layer == SLOTS


def test_a_budget_past_any_device_is_a_value_error_not_an_overflow():
    from tierkv.budget_change import parse_budget

    for value in (10**400, "99999999999999999999TiB", 2**50 + 1):
        with pytest.raises(ValueError, match=r"at most 1125899906842624 bytes \(1 PiB\)"):
            parse_budget(value)
    assert parse_budget(2**50) == 2**50
