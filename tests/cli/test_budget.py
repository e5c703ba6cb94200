"""`tierkv budget` and config reload: the GPU budget of a running TieredLLM changes, nothing else can."""
from __future__ import annotations

import pytest

from tests.metrics.test_prometheus import free_port
from tests.metrics.workload import make_llm
from tierkv.cli import main


TOKEN = "a-test-token-of-some-length"


def test_budget_command_resizes_a_running_tiered_llm(tmp_path, capsys):
    llm = make_llm(tmp_path, prometheus_port=free_port(), control_token=TOKEN)
    with llm:
        before = llm.runtime.residency.slots_per_layer
        new_budget = llm.config.cache.gpu_budget_bytes * 2
        assert main(["budget", "--token", TOKEN, "--endpoint", llm.metrics.url, str(new_budget)]) == 0
        assert llm.runtime.residency.slots_per_layer == 2 * before
        assert llm.stats()["gpu"]["budget_bytes"] == new_budget
        assert "GPU KV budget set to" in capsys.readouterr().out
        # a budget too small for sinks + window: refused by the process, exit 2, nothing changes
        assert main(["budget", "--token", TOKEN, "--endpoint", llm.metrics.url, "1"]) == 2
        assert "sinks + window" in capsys.readouterr().err
        assert llm.runtime.residency.slots_per_layer == 2 * before


@pytest.mark.parametrize("argv,code,message", [
    (["budget", "--endpoint", "http://127.0.0.1:9", "1GiB"], 1, "cannot reach"),
    (["budget", "--endpoint", "http://127.0.0.1:9", "lots"], 2, "size"),
    (["budget", "--endpoint", "http://127.0.0.1:9", "0"], 2, "must be positive"),
])
def test_budget_command_bad_arguments(argv, code, message, capsys):
    assert main(argv) == code
    assert message in capsys.readouterr().err


def test_budget_command_needs_an_endpoint(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["budget", "1GiB"])
    assert exited.value.code == 2
    assert "--endpoint" in capsys.readouterr().err


def test_config_reload_applies_the_budget_and_refuses_other_keys(tmp_path):
    llm = make_llm(tmp_path)
    with llm:
        config = llm.config
        budget = config.cache.gpu_budget_bytes
        changed = llm.reload_config({
            "model": {"name": config.model.name}, "cache": {**vars(config.cache), "gpu_budget_bytes": budget * 3},
            "tiers": [vars(t) for t in config.tiers], "scheduler": vars(config.scheduler), "metrics": vars(config.metrics),
        })
        assert changed == ["cache.gpu_budget_bytes"]
        assert llm.runtime.config.cache.gpu_budget_bytes == budget * 3
        with pytest.raises(ValueError, match="cache.block_tokens cannot change at run time"):
            llm.reload_config({"model": {"name": config.model.name}, "cache": {**vars(config.cache), "block_tokens": 8},
                               "tiers": [vars(t) for t in config.tiers], "scheduler": vars(config.scheduler),
                               "metrics": vars(config.metrics)})
