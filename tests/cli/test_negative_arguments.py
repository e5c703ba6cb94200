"""A negative size or number on the command line reaches the command's own check, by name: argparse alone reads
'-1GiB', '-4k', '-1e3' or '-inf' as an unknown option ("expected one argument", "required: size")."""
from __future__ import annotations

import pytest

from tierkv.cli import main

PLAN = ["plan", "--model-config", "llama-3.1-8b", "--context", "1k"]


@pytest.mark.parametrize("argv,message", [
    (["budget", "-1GiB", "--endpoint", "http://127.0.0.1:9"], "cannot read '-1GiB' as a size"),
    (["budget", "--endpoint", "http://127.0.0.1:9", "-1GiB"], "cannot read '-1GiB' as a size"),
    (["budget", "1GiB", "--endpoint", "http://127.0.0.1:9", "--timeout", "-1e3"], "--timeout: got -1000.0"),
    ([*PLAN, "--gpu-budget", "-1GiB"], "--gpu-budget: cannot read '-1GiB' as a size"),
    ([*PLAN, "--backend", "vllm", "--vllm-kv-pool", "-1GiB"], "--vllm-kv-pool: cannot read '-1GiB' as a size"),
    ([*PLAN, "--h2d-gbps", "-inf"], "--h2d-gbps: got -inf"),
    (["plan", "--model-config", "llama-3.1-8b", "--context", "-4k"], "--context: cannot read '-4k'"),
    (["run", "--demo", "--max-new-tokens", "-4k"], "--max-new-tokens: cannot read '-4k'"),
    (["run", "--demo", "--prompt-tokens", "-2k"], "--prompt-tokens: cannot read '-2k'"),
    (["run", "--demo", "--prompt-tokens", "8", "--temperature", "-1e-3"], "temperature: got -0.001"),
    (["top", "--jsonl", "x", "--interval", "-1e3"], "--interval: got -1000.0"),
    (["top", "--jsonl", "x", "--interval", "-INF"], "--interval: got -inf"),
    (["dashboard", "--jsonl", "x", "--port", "-1e3"], "invalid int value: '-1e3'"),
])
def test_a_negative_value_gets_the_commands_own_message(capsys, argv, message):
    try:
        code = main(argv)
    except SystemExit as exited:  # argparse's own type check (int) exits 2 too, naming the value
        code = exited.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "expected one argument" not in err and "are required" not in err, err
