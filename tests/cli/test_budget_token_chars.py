"""The control token's characters: one no client can send the same way (not printable ASCII) is refused where it
is configured, and `tierkv budget` strips a token's ends (a CRLF token file) and refuses, by its source and never
echoing it, one a header cannot carry (http.client's error printed it whole)."""
from __future__ import annotations

import pytest

from tests.metrics.test_prometheus import free_port
from tests.metrics.workload import make_llm
from tierkv.cli import main
from tierkv.config import ConfigError, MetricsConfig, load_config
from tierkv.redact import redact_text

TOKEN = "a-test-token-of-some-length"


@pytest.mark.parametrize("token", ["€" * 16 + "abc", "ñ" * 16 + "abc", "token-of-some\x07length", "token-of\nsome-length"])
def test_a_token_no_client_can_send_is_refused_where_it_is_configured(token, monkeypatch):
    from tierkv.metrics.control import BudgetControl

    with pytest.raises(ConfigError, match="printable ASCII") as refused:
        load_config({"metrics": {"control_enabled": True, "control_token": token}}, env={})
    assert token not in str(refused.value)
    monkeypatch.setenv("TIERKV_CONTROL_TOKEN", token)  # the variable is checked as the config is
    with pytest.raises(ConfigError, match="printable ASCII") as refused:
        BudgetControl.from_config(MetricsConfig(control_enabled=True), lambda budget: None)
    assert token not in str(refused.value)


def test_the_budget_command_strips_a_tokens_ends_and_never_prints_one_it_cannot_send(tmp_path, capsys, monkeypatch):
    llm = make_llm(tmp_path, prometheus_port=free_port(), control_token=TOKEN)
    with llm:
        budget = llm.config.cache.gpu_budget_bytes
        monkeypatch.setenv("TIERKV_CONTROL_TOKEN", TOKEN + "\r\n")  # read from a file written on Windows
        assert main(["budget", "--endpoint", llm.metrics.url, str(budget * 2)]) == 0
        assert llm.config.cache.gpu_budget_bytes == budget * 2
        capsys.readouterr()
        for bad, source in ((TOKEN + "\rX-Injected: 1", "TIERKV_CONTROL_TOKEN"), ("€" + TOKEN, "TIERKV_CONTROL_TOKEN")):
            monkeypatch.setenv("TIERKV_CONTROL_TOKEN", bad)
            assert main(["budget", "--endpoint", llm.metrics.url, "1MiB"]) == 2
            out = capsys.readouterr()
            assert f"the control token from {source}" in out.err and TOKEN not in out.err + out.out
        assert main(["budget", "--token", " " + TOKEN + "\t", "--endpoint", llm.metrics.url, "1MiB"]) == 0  # stripped
        assert main(["budget", "--token", "x\x00" + TOKEN, "--endpoint", llm.metrics.url, "1MiB"]) == 2
        assert "the control token from --token" in capsys.readouterr().err
        assert llm.config.cache.gpu_budget_bytes == 1 << 20


def test_a_bearer_credential_in_an_error_text_is_masked():
    text = "ValueError: Invalid header value b'Bearer SUPERSECRETVALUE123\\r'"
    assert "SUPERSECRET" not in redact_text(text) and "Bearer ***" in redact_text(text)
    assert redact_text("the bearer of good news") == "the bearer of good news"
