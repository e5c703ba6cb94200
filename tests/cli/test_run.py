"""`tierkv run`: the demo model and a local checkpoint, metrics JSONL and report; bad arguments."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.models import build
from tierkv.cli import main


@pytest.fixture
def config_path(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"""
model: {{name: cli-run-test}}
cache: {{block_tokens: 16, gpu_budget_bytes: 384KiB, sink_tokens: 16, window_tokens: 32}}
tiers:
  - {{kind: cpu, capacity_bytes: 4MiB}}
  - {{kind: disk, path: {tmp_path / 'disk'}, capacity_bytes: 16MiB, trusted: true}}
scheduler: {{lookahead_layers: 1, staging_bytes: 128KiB, prefill_chunk_tokens: 64}}
""")
    return str(path)


def test_demo_run_prints_tokens_a_prefill_bar_and_records_metrics(tmp_path, config_path, capsys):
    jsonl, report = tmp_path / "m.jsonl", tmp_path / "r.html"
    assert main(["run", "--demo", "--config", config_path, "--prompt-tokens", "300", "--max-new-tokens", "3",
                 "--jsonl", str(jsonl), "--report", str(report)]) == 0
    captured = capsys.readouterr()
    tokens = captured.out.split()
    assert len(tokens) == 3 and all(t.isdigit() for t in tokens)
    assert "prefill" in captured.err and "300/300" in captured.err  # tqdm's bar, on stderr
    assert "tierkv run: 300 prompt tokens (0 reused), 3 generated (length)" in captured.err
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [line["kind"] for line in lines][0] == "start" and lines[-1]["kind"] == "final"
    request = next(line for line in lines if line["kind"] == "request")["request"]
    assert request["prompt_tokens"] == 300 and request["generated_tokens"] == 3
    assert report.read_text().startswith("<!doctype html>")


def test_json_output_and_same_tokens_for_the_same_seed(config_path, capsys):
    argv = ["run", "--demo", "--config", config_path, "--prompt-tokens", "40", "--max-new-tokens", "2", "--json",
            "--quiet", "--temperature", "0.7", "--seed", "5"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    second = json.loads(capsys.readouterr().out)
    assert first["token_ids"] == second["token_ids"] and len(first["token_ids"]) == 2
    assert first["stats"]["prompt_tokens"] == 40 and "tiers" in first["totals"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    model, _ = build("llama", num_layers=2, seed=0)
    model.save_pretrained(path)
    return path


def test_a_local_checkpoint_with_a_prompt_file_of_token_ids(checkpoint, config_path, tmp_path, capsys):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(1, 90))))
    assert main(["run", "--model", str(checkpoint), "--config", config_path, "--prompt-file", str(ids),
                 "--max-new-tokens", "2", "--quiet", "--device", "cpu"]) == 0
    assert len(capsys.readouterr().out.split()) == 2


@pytest.mark.parametrize("extra,message", [
    (["--prompt", "hello"], "a text prompt needs a tokenizer"),
    (["--prompt-file", "/no/such/prompt.txt"], "cannot read /no/such/prompt.txt"),
    (["--prompt-tokens", "0"], "--prompt-tokens: '0' is 0 tokens"),
    (["--prompt-tokens", "20000"], "tiers[0].capacity_bytes"),
])
def test_bad_prompts_with_a_checkpoint_exit_2(checkpoint, config_path, capsys, extra, message):
    assert main(["run", "--model", str(checkpoint), "--config", config_path, "--quiet", *extra]) == 2
    last_line = capsys.readouterr().err.splitlines()[-1]  # after transformers' loading bar, when it loaded
    assert last_line.startswith("tierkv run: error:") and message in last_line


@pytest.mark.parametrize("ids,message", [
    ([1, 2.5], "token 1 is 2.5"), ([1, -1], "token 1 is -1"), ([3, 512], "token 1 is 512; token ids are ints in [0, 512)"),
    ([[1, 2], [3]], "request 0: token 0 is [1, 2]"), ([True, 1], "token 0 is True"), ([], "request 0: the prompt is empty"),
])
def test_bad_token_id_files_exit_2_and_name_the_token(checkpoint, config_path, tmp_path, capsys, ids, message):
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(ids))
    assert main(["run", "--model", str(checkpoint), "--config", config_path, "--quiet", "--prompt-file", str(path)]) == 2
    last_line = capsys.readouterr().err.splitlines()[-1]
    assert last_line.startswith("tierkv run: error:") and message in last_line


@pytest.mark.parametrize("argv,message", [
    (["run", "--demo", "--device", "gpu"], "--device: got 'gpu'"),
    (["run", "--demo", "--temperature", "nan"], "temperature: got nan"),
    (["run", "--demo", "--top-k", "0"], "top_k: got 0"),
    (["run", "--demo", "--temperature", "0.5", "--seed", "-2"], "seed: got -2"),
    (["run", "--demo", "--prompt", "some text"], "the demo model has no tokenizer"),
    (["run", "--model", "/no/such/model"], "give a prompt"),
    (["run", "--model", "/no/such/model", "--prompt-tokens", "4"], "not a local checkpoint directory, a .gguf file or one of: smollm2-135m"),
    (["run", "--demo", "--max-new-tokens", "0"], "--max-new-tokens: '0' is 0 tokens"),
    (["run", "--demo", "--max-new-tokens", "2x"], "--max-new-tokens: cannot read '2x' as a number of tokens"),
    (["run", "--demo", "--prompt-tokens", "1.5"], "--prompt-tokens: '1.5' is 1.5 tokens"),
    (["run", "--demo", "--top-p", "2"], "top_p: got 2.0"),
    (["run", "--demo", "--config", "/no/such.yaml"], "config_file"),
    (["run", "--demo", "--prometheus-port", "70000"], "--prometheus-port 70000: config key 'metrics.prometheus_port'"),
    (["run", "--demo", "--prometheus-port", "-1"], "--prometheus-port -1: config key 'metrics.prometheus_port'"),
    (["run", "--demo", "--jsonl", "/tmp"], "--jsonl /tmp: config key 'metrics.jsonl_path': got '/tmp'; expected a file"),
    (["run", "--demo", "--report", "/proc/r.html"], "--report /proc/r.html: expected a writable directory"),
    # the report is written after the run: its path is checked before it, beside a --jsonl of its own too
    (["run", "--demo", "--jsonl", "/tmp/tierkv-run-test.jsonl", "--report", "/proc/r.html"], "--report /proc/r.html"),
    (["run", "--demo", "--report", "/tmp"], "--report /tmp: expected a file; it is a directory"),
])
def test_bad_arguments_exit_2_naming_the_problem(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierkv run: error:") and message in err


def test_missing_or_conflicting_model_is_a_usage_error(capsys):
    for argv in (["run", "--prompt-tokens", "3"], ["run", "--demo", "--model", "x"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("quiet", [False, True])
def test_decode_progress_bar_with_tokens_per_second_on_stderr_unless_quiet(config_path, capsys, quiet):
    argv = ["run", "--demo", "--config", config_path, "--prompt-tokens", "40", "--max-new-tokens", "20"]
    assert main(argv + ["--quiet"] * quiet) == 0
    captured = capsys.readouterr()
    assert len(captured.out.split()) == 20  # the tokens; never a bar on stdout
    assert "decode" not in captured.out and "tok/s" not in captured.out
    if quiet:
        assert captured.err == ""
    else:
        assert "decode: 100%" in captured.err and "20/20" in captured.err and "tok/s" in captured.err


def test_decode_progress_bar_of_tiered_llm_follows_show_progress(tmp_path, capsys):
    from tests.metrics.workload import make_config
    from tierkv.llm import DECODE_PROGRESS_MIN_TOKENS, TieredLLM
    from tierkv.sampling import SamplingParams

    model, _ = build("llama", num_heads=8, num_kv_heads=2, num_layers=2, seed=0)
    for show, new_tokens, expect_bar in ((True, DECODE_PROGRESS_MIN_TOKENS, True), (False, 24, False),
                                         (True, DECODE_PROGRESS_MIN_TOKENS - 1, False)):
        with TieredLLM(model, make_config(tmp_path / f"{show}-{new_tokens}"), show_progress=show) as llm:
            (out,) = llm.generate([list(range(1, 30))], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        err = capsys.readouterr().err
        assert len(out.token_ids) == new_tokens
        assert ("decode" in err and f"{new_tokens}/{new_tokens}" in err and "tok/s" in err) == expect_bar, err


def test_a_decode_ended_by_a_stop_token_shows_a_full_bar(tmp_path, capsys):
    from tests.metrics.workload import make_config
    from tierkv.llm import DECODE_PROGRESS_MIN_TOKENS, TieredLLM
    from tierkv.sampling import SamplingParams

    model, _ = build("llama", num_heads=8, num_kv_heads=2, num_layers=2, seed=0)
    prompt = list(range(1, 30))
    with TieredLLM(model, make_config(tmp_path / "free"), show_progress=False) as llm:
        (free,) = llm.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))
    stop = free.token_ids[4]  # greedy: the same tokens again, ended at this one's first appearance
    made = free.token_ids.index(stop) + 1
    with TieredLLM(model, make_config(tmp_path / "stop"), show_progress=True) as llm:
        (out,) = llm.generate([prompt], SamplingParams(max_new_tokens=DECODE_PROGRESS_MIN_TOKENS + 8,
                                                       ignore_eos=True, stop_token_ids=[stop]))
    err = capsys.readouterr().err
    assert out.finish_reason == "stop" and len(out.token_ids) == made
    last = err.split("decode")[-1]  # the bar's final rendering
    assert f"{made}/{made}" in last and "100%" in last, err


def _real_model_config(tmp_path):
    """A CPU-only config for the real model's runs (no disk tier, a small hot window)."""
    config = tmp_path / "real.yaml"
    config.write_text("cache: {block_tokens: 16, gpu_budget_bytes: 8MiB, sink_tokens: 16, window_tokens: 64}\n"
                      "tiers: [{kind: cpu, capacity_bytes: 256MiB}]\n"
                      "scheduler: {staging_bytes: 4MiB, lookahead_layers: 1}\n")
    return config


def test_run_takes_the_real_models_shortcut(tmp_path, capsys):
    pytest.importorskip("gguf")
    config = _real_model_config(tmp_path)
    argv = ["run", "--model", "smollm2-135m", "--config", str(config), "--prompt", "The capital of France is",
            "--max-new-tokens", "3", "--quiet"]
    assert main(argv) == 0
    assert "Paris" in capsys.readouterr().out


def test_chat_wraps_the_question_in_the_models_template_and_raw_text_gets_a_hint(tmp_path, capsys):
    pytest.importorskip("gguf")
    config = _real_model_config(tmp_path)
    argv = ["run", "--model", "smollm2-135m", "--config", str(config), "--prompt", "What is the capital of France?",
            "--max-new-tokens", "12"]
    assert main(argv + ["--chat"]) == 0
    chat = capsys.readouterr()
    assert "Paris" in chat.out and "add --chat" not in chat.err
    assert main(argv) == 0  # raw text: this instruct model stops at once
    raw = capsys.readouterr()
    assert "Paris" not in raw.out and "add --chat" in raw.err


def test_chat_needs_text(capsys):
    assert main(["run", "--demo", "--prompt-tokens", "8", "--chat"]) == 2
    assert "--chat wraps text" in capsys.readouterr().err


def test_a_prompt_file_that_is_not_utf8_exits_2_naming_it(tmp_path, capsys):
    path = tmp_path / "bin.txt"
    path.write_bytes(b"ok\xff\xfe")
    assert main(["run", "--demo", "--prompt-file", str(path)]) == 2
    assert f"--prompt-file: {path} is not UTF-8 text (byte 2: b'\\xff')" in capsys.readouterr().err


def test_the_port_flag_counts_for_a_config_that_enables_the_control(tmp_path, config_path, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "control.yaml"
    config.write_text(open(config_path).read() + "metrics: {control_enabled: true, host: 127.0.0.1, "
                      "control_token: 0123456789abcdef0123456789abcdef}\n")
    argv = ["run", "--demo", "--config", str(config), "--prompt-tokens", "8", "--max-new-tokens", "2", "--quiet"]
    assert main(argv) == 2
    assert "set metrics.prometheus_port too" in capsys.readouterr().err
    assert main(argv + ["--prometheus-port", str(port)]) == 0


def _readme_block(containing: str) -> str:
    """The README's fenced Python block that contains `containing`, as written."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    (block,) = [b for b in blocks if containing in b]
    return block


def test_the_readme_cpu_example_runs_as_written(tmp_path, monkeypatch, capsys):
    """README's CPU snippet, pasted alone (its imports included): the main job's model under
    configs/smollm2-135m.yaml (its disk tier sent to tmp) answers."""
    pytest.importorskip("gguf")
    monkeypatch.setenv("TIERKV_TIERS__1__PATH", str(tmp_path / "disk"))
    monkeypatch.setenv("TIERKV_STORAGE__SECRET_FILE", str(tmp_path / "secret"))
    block = _readme_block('TieredLLM("smollm2-135m", "smollm2-135m")')
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    namespace["llm"].close()
    assert "Paris" in capsys.readouterr().out


def test_the_readme_cpu_command_names_the_config_its_snippet_uses():
    """The shell form the README gives for the CPU snippet runs the same config (without --config,
    `tierkv run` takes the built-in defaults: no disk tier, nothing reused on the next run)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    command = re.search(r"`(tierkv run --model smollm2-135m[^`]*)`", readme.replace("\n", " "))
    assert command is not None and "--config smollm2-135m" in command.group(1)
