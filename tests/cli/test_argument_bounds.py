"""Arguments a control-plane probe found crossing into tracebacks, huge allocations or silent ignoring:
each now exits 2 naming the argument, before any work (`--prompt-tokens 32M` built a 32M-token prompt, 2 GB,
before the CPU tier's check; `--device` was ignored by `--demo`)."""
from __future__ import annotations

import json
import time

import pytest
import torch

from tierkv.cli import main

ARTIFACT = "<a metrics JSONL>"  # written per test (tests/artifacts is not in the repository)


@pytest.mark.parametrize("args,message", [
    (["run", "--demo", "--device", "meta", "--prompt-tokens", "8"], "--device meta: tierkv runs on cpu or cuda"),
    (["run", "--demo", "--device", "mps", "--prompt-tokens", "8"], "--device mps"),
    (["run", "--demo", "--prompt-tokens", "99999999999999999999999"], "at most 1073741824 (1024M) tokens"),
    (["run", "--demo", "--prompt-tokens", "32M", "--quiet"], "--prompt-tokens 32M: a request of 33554"),
    (["plan", "--model-config", "llama-3.1-8b", "--context", "999999999999999999999999"], "--context"),
    (["plan", "--model-config", "llama-3.1-8b", "--context", "128k", "--gpu-budget", "9" * 32],
     "--gpu-budget 9999"),
    (["dashboard", "--jsonl", ARTIFACT, "--host", "999.1.1.1", "--port", "0"], "--host 999.1.1.1"),
    (["plan", "--model-config", "llama-3.1-8b", "--context", "128k", "--gpu-budget", "0"], "--gpu-budget: got 0"),
    (["plan", "--model-config", "llama-3.1-8b", "--context", "128k", "--vllm-kv-pool", "0"], "--vllm-kv-pool: got 0"),
    (["plan", "--model-config", "llama-3.1-8b", "--context", "128k", "--h2d-gbps", "1e-300"], "expected GB/s from"),
    (["plan", "--model-config", "llama-3.1-8b", "--context", "128k", "--max-num-seqs", "5"], "only --backend vllm"),
    (["run", "--demo", "--prompt-tokens", "8", "--seed", str(2**70)], "--seed: got 1180591620717411303424"),
    (["run", "--demo", "--prompt-tokens", "8", "--seed", "-1"], "--seed: got -1"),
    (["run", "--model", "<bad config.json>", "--prompt", "x"], "its config.json cannot be read as JSON"),
    (["run", "--model", "<no weights>", "--prompt", "x"], "the directory has no weights"),
])
def test_a_bad_argument_exits_2_naming_it_before_any_work(capsys, tmp_path, args, message):

    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text(json.dumps({"schema": "tierkv.metrics/1", "run_id": "x", "seq": 0, "kind": "final", "t": 1.0,
                                 "elapsed_s": 0.0, "figures": {}, "rates": {}, "latency": {}, "info": {}}) + "\n")
    bad_json, no_weights = tmp_path / "bad", tmp_path / "empty"
    for directory, text in ((bad_json, "{not json"), (no_weights, '{"model_type": "llama"}')):
        directory.mkdir()
        (directory / "config.json").write_text(text)
    named = {ARTIFACT: str(jsonl), "<bad config.json>": str(bad_json), "<no weights>": str(no_weights)}
    args = [named.get(a, a) for a in args]
    started = time.perf_counter()
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert time.perf_counter() - started < 30  # refused before building anything large


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_cuda_device_on_a_machine_without_one_is_refused(capsys):
    assert main(["run", "--demo", "--device", "cuda", "--prompt-tokens", "8"]) == 2
    assert "--device cuda: this machine has no CUDA device" in capsys.readouterr().err

