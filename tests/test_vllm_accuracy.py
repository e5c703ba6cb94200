"""benchmarks/vllm_accuracy.py on CPU: the GGUF -> folder conversion keeps the GGUF model's logits and
writes both names of the tied embedding; the prompts are bench_accuracy's; the tierkv configs pass
tierkv's own start-up checks for this and other model shapes; the engines are built and read as vLLM's
outputs say (vLLM replaced by a stand-in: the real engines need a GPU); a failing length or engine is
recorded and the rest kept; the table counts accuracy and token matches; bad arguments are refused."""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import vllm_accuracy
from benchmarks.vllm_accuracy_engines import (MAX_MODEL_LEN, MODES, NEW_TOKENS, Completion, Engine, KvShape, engine_kwargs,
                                              start_engine, tierkv_config)
from benchmarks.vllm_accuracy_prompts import FULL, SMOKE, Grid, build_prompts, score
from tests.vllm_engine_fake import FakeEngineBase
from benchmarks.vllm_accuracy_table import accuracy_rows, format_table, load_runs, token_match


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the GGUF-loaded model, the folder convert wrote), converted once for the module (about 20 s)."""
    pytest.importorskip("gguf", reason="the real-model extra is not installed (pip install -e '.[real-model]')")
    from benchmarks.vllm_accuracy_convert import convert
    from tierkv.model_loading import resolve_checkpoint

    torch.set_num_threads(2)
    folder = tmp_path_factory.mktemp("smollm2")
    model = convert(resolve_checkpoint("smollm2-135m").model_id, folder)
    return model, str(folder)


@pytest.fixture(scope="module")
def folder_tokenizer(converted):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted[1])


# -- convert -------------------------------------------------------------------------------------------

@pytest.mark.real_model
def test_the_folder_gives_the_gguf_models_logits_and_holds_both_embedding_names(converted):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    gguf_model, folder = converted
    tensors = load_file(f"{folder}/model.safetensors")
    assert "model.embed_tokens.weight" in tensors and "lm_head.weight" in tensors
    assert torch.equal(tensors["model.embed_tokens.weight"], tensors["lm_head.weight"])
    assert torch.equal(tensors["model.embed_tokens.weight"], gguf_model.model.embed_tokens.weight)
    assert set(tensors) == set(gguf_model.state_dict()) | {"lm_head.weight"}
    config = json.loads(open(f"{folder}/config.json").read())
    assert "quantization_config" not in config and config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert config["rope_theta"] == gguf_model.config.rope_parameters["rope_theta"]
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    assert loaded.config.rope_parameters["rope_theta"] == gguf_model.config.rope_parameters["rope_theta"]
    ids = torch.tensor([[1, 504, 3458, 282, 2114, 314, 253, 1345, 30, 476, 2]])
    with torch.no_grad():
        ours, reference = loaded(ids).logits, gguf_model(ids).logits
    assert ours.dtype == reference.dtype == torch.bfloat16
    assert torch.equal(ours, reference)


def test_convert_refuses_what_is_not_a_gguf_file_or_a_known_dtype(tmp_path):
    from benchmarks.vllm_accuracy_convert import convert

    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="expected an existing .gguf file"):
        convert(tmp_path / "model.bin", tmp_path / "out")
    (tmp_path / "m.gguf").write_bytes(b"x")
    with pytest.raises(ValueError, match="dtype: got 'int8'; allowed: bfloat16, float16"):
        convert(tmp_path / "m.gguf", tmp_path / "out", dtype="int8")


def test_weight_tensors_write_a_tied_embedding_under_both_names_from_either():
    from benchmarks.vllm_accuracy_convert import weight_tensors

    class Tied(torch.nn.Module):
        def __init__(self, names):
            super().__init__()
            self.config = SimpleNamespace(tie_word_embeddings=True)
            self.names = names

        def state_dict(self):
            return {name: torch.arange(6.0).view(2, 3) for name in self.names}

    for names in (["model.embed_tokens.weight"], ["lm_head.weight"], ["model.embed_tokens.weight", "lm_head.weight"]):
        tensors = weight_tensors(Tied(names))
        assert torch.equal(tensors["model.embed_tokens.weight"], tensors["lm_head.weight"])
        assert tensors["lm_head.weight"].data_ptr() != tensors["model.embed_tokens.weight"].data_ptr()
    with pytest.raises(ValueError, match="neither model.embed_tokens.weight nor lm_head.weight"):
        weight_tensors(Tied(["model.norm.weight"]))


# -- prompts -------------------------------------------------------------------------------------------

@pytest.mark.real_model
def test_the_prompts_are_the_ones_bench_accuracy_runs(converted, folder_tokenizer, monkeypatch):
    """bench_accuracy.run_retrieval (the GGUF's own tokenizer) feeds the model exactly the token ids that
    build_prompts makes from the converted folder's tokenizer, in the same order."""
    import tierkv.longdoc
    from benchmarks import bench_accuracy
    from transformers import AutoTokenizer
    from tierkv.model_loading import resolve_checkpoint

    source = resolve_checkpoint("smollm2-135m")
    gguf_tokenizer = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
    fed = []
    monkeypatch.setattr(tierkv.longdoc, "dense_greedy", lambda model, ids, *a, **k: (fed.append(list(ids)), ([], None))[1])
    monkeypatch.setattr(bench_accuracy, "tiered_greedy", lambda *a, **k: ([], None, None))
    args = bench_accuracy.parse_args(["--parts", "retrieval", "--retrieval-tokens", "512,1500", "--depths", "0.1,0.9",
                                      "--seeds", "0,1", "--sparse-budgets", "100000", "--no-recall"])
    bench_accuracy.run_retrieval(converted[0], gguf_tokenizer, args, "/nonexistent")
    grid = Grid(context_tokens=(512, 1500), depths=(0.1, 0.9), seeds=(0, 1))
    prompts = build_prompts(folder_tokenizer, grid, MAX_MODEL_LEN)
    assert [p.ids for p in prompts] == fed and len(fed) == 16
    assert [(p.row["task"], p.row["context_tokens"], p.row["depth"], p.row["seed"]) for p in prompts][:3] == [
        ("passkey", 512, 0.1, 0), ("passkey", 512, 0.1, 1), ("passkey", 512, 0.9, 0)]
    assert folder_tokenizer.decode(prompts[0].ids).count("<|im_start|>assistant") == 1  # the chat template applied


@pytest.mark.real_model
def test_the_full_grid_fits_max_model_len_and_a_too_long_prompt_is_named(folder_tokenizer):
    prompts = build_prompts(folder_tokenizer, FULL, MAX_MODEL_LEN - NEW_TOKENS)
    assert len(prompts) == 48 and len(build_prompts(folder_tokenizer, SMOKE, MAX_MODEL_LEN)) == 2
    assert {p.row["context_tokens"] for p in prompts} == {2048, 4096, 6144, 8000}
    longest = max(len(p.ids) for p in prompts)
    assert 8000 < longest <= MAX_MODEL_LEN - NEW_TOKENS
    assert all(p.row["prompt_tokens"] == len(p.ids) and p.row["answer"].isdigit() for p in prompts)
    assert all("error" not in p.row for p in prompts)
    short = build_prompts(folder_tokenizer, Grid((1000, 2048), (0.5,), (0,), ("passkey",)), 2048)
    assert "error" not in short[0].row  # only the prompt past the limit is marked, and not run
    assert short[1].row["error"].startswith(f"the prompt has {len(short[1].ids)} tokens, over the 2048")
    with pytest.raises(ValueError, match="tasks: got"):
        build_prompts(folder_tokenizer, Grid((512,), (0.5,), (0,), ("haystack",)), MAX_MODEL_LEN)


@settings(max_examples=100, deadline=None)
@given(answer=st.from_regex(r"[1-9][0-9]{4}", fullmatch=True), text=st.text(alphabet="0123456789 abc.", max_size=30),
       spaced=st.booleans())
def test_score_is_bench_accuracys_rule(answer, text, spaced):
    from benchmarks import bench_accuracy

    if spaced:
        text = text + " ".join(answer)  # digits the model spaced out still count, as in bench_accuracy
    decoder = SimpleNamespace(decode=lambda tokens, skip_special_tokens: text)
    row = bench_accuracy._scored({"answer": answer}, "dense", None, None, decoder, [])
    assert score(answer, text) is row["correct"]


# -- engines -------------------------------------------------------------------------------------------

def _checkpoint(tmp_path, layers=30, heads=9, kv_heads=3, head_dim=64, dtype="bfloat16"):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "hidden_size": heads * head_dim, "max_position_embeddings": MAX_MODEL_LEN,
        "dtype": dtype, "architectures": ["LlamaForCausalLM"]}))
    return str(tmp_path)


def _check_fits(model_dir: str, mode: str) -> dict:
    """What TieredLLM does with the mode's config before vLLM starts, and the sparse caches' split."""
    pytest.importorskip("vllm")
    from tierkv.config import load_config
    from tierkv.integrations.vllm.engine_args import tiered_engine_args
    from tierkv.integrations.vllm.pool_sizing import hot_window_pool_need
    from tierkv.sparse.row_caches import cache_rows

    shape = KvShape.of_checkpoint(model_dir)
    config = load_config(tierkv_config(mode, shape), env={})
    kwargs = engine_kwargs(mode)
    user = {k: v for k, v in kwargs.items() if k not in ("max_model_len", "gpu_memory_utilization")}
    args = tiered_engine_args(model_dir, config, "unused.yaml", user, hot_window=True, max_model_len=MAX_MODEL_LEN,
                              gpu_memory_utilization=kwargs["gpu_memory_utilization"], enable_prefix_caching=None)
    pool, sched = args.kwargs["kv_cache_memory_bytes"], config.scheduler
    assert pool >= hot_window_pool_need(model_dir, config, args.kwargs)
    assert pool + sched.staging_bytes + args.summary_reserved_bytes <= config.cache.gpu_budget_bytes
    assert args.kwargs["max_model_len"] == MAX_MODEL_LEN and args.kwargs["enable_prefix_caching"] is False
    if sched.policy == "sparse":
        k, block_bytes = sched.sparse_token_budget // config.cache.block_tokens, shape.block_bytes(config.cache.block_tokens)
        assert cache_rows(1, 1, sched.staging_bytes, 2 * k * block_bytes, shape.num_layers, k, block_bytes, 0) == (1, True, None)
        assert args.summary_reserved_bytes > 0
    assert args.kwargs["max_num_seqs"] == 1
    return {"budget": config.cache.gpu_budget_bytes, "request": shape.request_kv_bytes}


def test_the_tierkv_configs_pass_tierkvs_checks_for_smollm2(tmp_path):
    """SmolLM2-135M's shape (30 layers, 3 KV heads, head_dim 64, bfloat16): exact at 1/8 of an 8k request's
    KV, sparse within its window, cache and summaries."""
    exact = _check_fits(_checkpoint(tmp_path), "tierkv-exact")
    assert exact["budget"] == exact["request"] // 8 == 30 * 2 * 3 * 64 * 2 * 8192 // 8
    sparse = _check_fits(_checkpoint(tmp_path), "tierkv-sparse")
    assert sparse["budget"] < sparse["request"] // 4


@settings(max_examples=25, deadline=None)
@given(layers=st.integers(1, 48), kv_heads=st.sampled_from([1, 2, 4, 8]), head_dim=st.sampled_from([32, 64, 128, 256]),
       dtype=st.sampled_from(["bfloat16", "float32"]), mode=st.sampled_from(["tierkv-exact", "tierkv-sparse"]))
def test_the_tierkv_configs_fit_other_model_shapes(tmp_path_factory, layers, kv_heads, head_dim, dtype, mode):
    _check_fits(_checkpoint(tmp_path_factory.mktemp("ckpt"), layers, 2 * kv_heads, kv_heads, head_dim, dtype), mode)


def test_tierkv_config_refuses_an_unknown_mode_or_budget():
    shape = KvShape(30, 3, 64, 2)
    with pytest.raises(ValueError, match="mode: got 'plain'"):
        tierkv_config("plain", shape)
    with pytest.raises(ValueError, match="--sparse-token-budget: got 100"):
        tierkv_config("tierkv-sparse", shape, 100)


def _vllm_output(token_ids, text, logprobs):
    steps = [{t: SimpleNamespace(logprob=lp) for t, lp in zip((1, 2, 3), row)} for row in logprobs]
    completion = SimpleNamespace(token_ids=token_ids, text=text, logprobs=steps, finish_reason="length")
    return SimpleNamespace(outputs=[completion], prompt_token_ids=[5, 6], num_cached_tokens=0, request_id="0",
                           prompt=None)


def _fake_vllm(monkeypatch, seen):
    vllm = pytest.importorskip("vllm")

    class FakeLLM(FakeEngineBase):  # what start_engine and VllmTieredLLM read of vLLM's engine
        def __init__(self, **kwargs):
            seen.update(kwargs)
            super().__init__(**kwargs)

        def generate(self, inputs, params, use_tqdm=False):
            seen["params"], seen["inputs"] = params, inputs
            return [_vllm_output([7, 8, 9], "x", [[-0.1, -2.5], [-0.2, -3.0], [-0.5, -0.6]]) for _ in inputs]

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_V2_MODEL_RUNNER"):
        monkeypatch.setenv(name, "0")


@pytest.mark.parametrize("mode", ["plain", "tierkv-exact", "tierkv-sparse"])
def test_each_engine_is_built_greedy_and_read_in_order(tmp_path, monkeypatch, mode):
    seen = {}
    _fake_vllm(monkeypatch, seen)
    model = _checkpoint(tmp_path)
    config = None if mode == "plain" else tierkv_config(mode, KvShape.of_checkpoint(model))
    engine = start_engine(mode, model, config)
    out = engine.generate([[5, 6], [5, 6, 7]])
    assert out == [Completion([7, 8, 9], "x", [[-0.1, -2.5], [-0.2, -3.0], [-0.5, -0.6]])] * 2
    assert seen["inputs"] == [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [5, 6, 7]}]
    params = seen["params"]
    assert params.temperature == 0.0 and params.max_tokens == NEW_TOKENS and not params.ignore_eos
    assert seen["max_model_len"] == MAX_MODEL_LEN and seen["enforce_eager"] is True
    assert seen["enable_prefix_caching"] is False
    if mode == "plain":
        assert seen["gpu_memory_utilization"] == 0.3 and seen["attention_config"] == {"backend": "FLASH_ATTN"}
        assert "kv_transfer_config" not in seen and engine.stats() == {}
    else:
        assert seen["attention_config"] == {"backend": "CUSTOM"} and seen["kv_transfer_config"]
        assert seen["block_size"] == config["cache"]["block_tokens"]
        assert seen["max_num_batched_tokens"] == config["scheduler"]["prefill_chunk_tokens"]
        assert engine.stats()["requests"]
        assert seen["max_num_seqs"] == 1


# -- run: every length in its own try, the JSON written as it goes ---------------------------------------

@pytest.mark.real_model
def test_run_keeps_the_lengths_that_worked_and_records_the_one_that_failed(converted, folder_tokenizer, monkeypatch,
                                                                            tmp_path):
    grid = Grid(context_tokens=(512, 700, 1500), depths=(0.5,), seeds=(0,))
    prompts = build_prompts(folder_tokenizer, grid, MAX_MODEL_LEN)
    answers = {tuple(p.ids): p.row["answer"] for p in prompts}
    calls = []

    def generate(batch):
        calls.append(len(batch))
        if len(batch[0]) > 650:
            raise RuntimeError("the engine died at 700")
        right = folder_tokenizer(" " + answers[tuple(batch[0])], add_special_tokens=False)["input_ids"]
        return [Completion(right, "vllm text", [[-0.1, -1.0]]), Completion([28, 29], "no", [[-0.3, -0.4]])]

    monkeypatch.setattr(vllm_accuracy, "SMOKE", grid)
    monkeypatch.setattr(vllm_accuracy, "MAX_MODEL_LEN", 1200)  # the 1500-token prompts do not fit: marked, not run
    monkeypatch.setattr(vllm_accuracy, "start_engine", lambda mode, model_dir, config: Engine(generate, lambda: {"n": 1}))
    rc = vllm_accuracy.run("tierkv-exact", converted[1], str(tmp_path), smoke=True)
    assert rc == 1 and calls == [2, 2]  # one call per length: passkey and multikey together
    record = json.loads((tmp_path / "vllm-acc-smoke-tierkv-exact.json").read_text())
    assert record["command"] and record["git_commit"] is not None and record["date"] and record["device"]
    results = record["results"]
    assert results["config"]["scheduler"]["prefill_chunk_tokens"] == 512 and results["engine_stats"] == {"n": 1}
    first, second = [p for p in results["prompts"] if p["context_tokens"] == 512]
    assert first["correct"] is True and first["decoded"].strip() == first["answer"] and first["text"] == "vllm text"
    assert second["correct"] is False and second["token_ids"] == [28, 29] and second["top2_logprobs"] == [[-0.3, -0.4]]
    failed = [p for p in results["prompts"] if p["context_tokens"] == 700]
    assert len(failed) == 2 and all(p["error"] == "RuntimeError: the engine died at 700" for p in failed)
    assert all("token_ids" not in p for p in failed)
    too_long = [p for p in results["prompts"] if p["context_tokens"] == 1500]
    assert len(too_long) == 2 and all(p["error"].startswith("the prompt has") and "token_ids" not in p for p in too_long)
    assert [(g["context_tokens"], g["prompts"]) for g in results["groups"]] == [(512, 2), (700, 2), (1500, 0)]
    assert results["stage"] == "done" and 0 < results["gpu_budget_of_request_kv"] <= 1 / 8


@pytest.mark.real_model
def test_run_records_an_engine_that_does_not_start(converted, monkeypatch, tmp_path):
    def refuse(mode, model_dir, config):
        raise RuntimeError("no GPU")

    monkeypatch.setattr(vllm_accuracy, "start_engine", refuse)
    assert vllm_accuracy.run("tierkv-sparse", converted[1], str(tmp_path), smoke=True, sparse_token_budget=256) == 1
    results = json.loads((tmp_path / "vllm-acc-smoke-tierkv-sparse.json").read_text())["results"]
    assert results["error"] == "start: RuntimeError: no GPU" and len(results["prompts"]) == 2
    assert results["stage"] == "start"
    assert results["config"]["scheduler"]["sparse_token_budget"] == 256
    assert vllm_accuracy.table(str(tmp_path), smoke=True) == 0


@pytest.mark.real_model
def test_a_tagged_run_of_some_lengths_has_its_own_file_budget_and_table_row(converted, monkeypatch, tmp_path):
    """run_gpu.py's vllm-accuracy runs tierkv-sparse once per length with its own budget: --contexts keeps
    those lengths only, --tag names the file (the untagged run's file is left alone), the config carries
    the block and budget given, and the table lists the run under MODE-TAG."""
    grid = Grid(context_tokens=(512, 700), depths=(0.5,), seeds=(0,))
    batches, configs = [], []

    def start(mode, model_dir, config):
        configs.append(config)
        return Engine(lambda batch: batches.append(batch) or [Completion([28], "x", [[-0.1, -1.0]]) for _ in batch],
                      lambda: {})

    monkeypatch.setattr(vllm_accuracy, "SMOKE", grid)
    monkeypatch.setattr(vllm_accuracy, "start_engine", start)
    (tmp_path / "vllm-acc-smoke-tierkv-sparse.json").write_text(json.dumps({"results": {"prompts": []}}))
    assert vllm_accuracy.run("tierkv-sparse", converted[1], str(tmp_path), smoke=True, sparse_token_budget=128,
                             sparse_block_tokens=16, contexts=(700,), tag="q700") == 0
    results = json.loads((tmp_path / "vllm-acc-smoke-tierkv-sparse-q700.json").read_text())["results"]
    assert {p["context_tokens"] for p in results["prompts"]} == {700} and len(batches) == 1 and len(batches[0]) == 2
    assert configs[0]["cache"]["block_tokens"] == 16 and configs[0]["scheduler"]["sparse_token_budget"] == 128
    assert json.loads((tmp_path / "vllm-acc-smoke-tierkv-sparse.json").read_text()) == {"results": {"prompts": []}}
    assert list(load_runs(tmp_path, MODES, smoke=True)) == ["tierkv-sparse", "tierkv-sparse-q700"]
    lines = [line.split() for line in format_table(load_runs(tmp_path, MODES, smoke=True)).splitlines()]
    assert ["tierkv-sparse-q700", "700", "passkey", "0/1", "0"] in lines


# -- table ---------------------------------------------------------------------------------------------

def _prompt(task, context, depth, seed, tokens, correct, top2=None):
    row = {"task": task, "context_tokens": context, "depth": depth, "seed": seed, "answer": "12345"}
    if tokens is None:
        return {**row, "error": "RuntimeError: x"}
    return {**row, "token_ids": tokens, "correct": correct, "top2_logprobs": top2 or [[-0.1, -2.0]] * len(tokens)}


def _runs():
    plain = {"prompts": [_prompt("passkey", 2048, 0.1, 0, [1, 2, 3], True),
                         _prompt("passkey", 2048, 0.5, 0, [1, 2, 4], False, [[-0.1, -2.0], [-0.2, -0.25], [-0.1, -3.0]]),
                         _prompt("multikey", 2048, 0.1, 0, [5, 6], True),
                         _prompt("passkey", 4096, 0.1, 0, [7], True),
                         _prompt("passkey", 4096, 0.5, 0, None, None)]}
    exact = {"prompts": [_prompt("passkey", 2048, 0.1, 0, [1, 2, 3], True),
                         _prompt("passkey", 2048, 0.5, 0, [1, 9, 4], True),
                         _prompt("multikey", 2048, 0.1, 0, [5, 6], True),
                         _prompt("passkey", 4096, 0.1, 0, None, None),
                         _prompt("passkey", 4096, 0.5, 0, [8], False)]}
    return plain, exact


def test_accuracy_counts_correct_and_errors_per_length_and_task():
    plain, exact = _runs()
    assert accuracy_rows(plain) == [
        {"context_tokens": 2048, "task": "multikey", "cases": 1, "correct": 1, "errors": 0},
        {"context_tokens": 2048, "task": "passkey", "cases": 2, "correct": 1, "errors": 0},
        {"context_tokens": 4096, "task": "passkey", "cases": 2, "correct": 1, "errors": 1}]
    assert [r["correct"] for r in accuracy_rows(exact)] == [1, 2, 0]


def test_token_match_counts_identical_prompts_and_names_the_first_difference():
    plain, exact = _runs()
    match = token_match(plain, exact)
    # compared: prompts both completed (4096/0.1 failed in exact, 4096/0.5 in plain)
    assert match["identical"] == 2 and match["compared"] == 3
    first = match["first_difference"]
    assert (first["task"], first["context_tokens"], first["depth"], first["step"]) == ("passkey", 2048, 0.5, 1)
    assert first["plain_top2_margin"] == pytest.approx(0.05)
    assert token_match(plain, plain) == {"identical": 4, "compared": 4, "first_difference": None}
    shorter = {"prompts": [_prompt("passkey", 2048, 0.1, 0, [1, 2], True)]}  # stopped early: differs at step 2
    assert token_match(plain, shorter)["first_difference"]["step"] == 2
    assert token_match(plain, shorter)["first_difference"]["plain_top2_margin"] == pytest.approx(1.9)


def test_table_prints_accuracy_and_token_matches_and_exits_zero(tmp_path, capsys):
    plain, exact = _runs()
    runs = (("plain", plain), ("tierkv-exact", exact), ("tierkv-sparse", {"error": "start: X", "prompts": []}))
    for mode, results in runs:
        (tmp_path / f"vllm-acc-{mode}.json").write_text(json.dumps({"results": results}))
    assert vllm_accuracy.main(["table", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "tierkv-exact token ids equal to plain: 2/3 prompts; first difference: passkey 2048 depth 0.5 seed 0, step 1" in text
    assert "tierkv-sparse  engine error: start: X" in text
    lines = [line.split() for line in text.splitlines()]
    assert ["plain", "4096", "passkey", "1/1", "1"] in lines and ["tierkv-exact", "2048", "passkey", "2/2", "0"] in lines
    assert format_table({"plain": plain}).count("\n") == 3  # header and three rows, no match line without a tierkv mode
    killed = format_table({"tierkv-exact": {**exact, "stage": "generate 4096"}})
    assert "tierkv-exact   stopped at stage: generate 4096 (killed or timed out)" in killed


# -- arguments and the step runner ---------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["run", "dense", "{d}", "{d}"], "argument mode: invalid choice: 'dense'"),
    (["run", "plain", "{d}/nothing", "{d}"], "no config.json there"),
    (["convert", "{d}/missing.gguf", "{d}/out"], "GGUF: got '{d}/missing.gguf'; expected an existing .gguf file"),
    (["convert", "{d}/config.json", "{d}/out"], "expected an existing .gguf file"),
    (["table", "{d}/nothing"], "OUTDIR: got '{d}/nothing'; not a directory"),
    (["run", "tierkv-sparse", "{d}", "{d}", "--sparse-token-budget", "100"], "--sparse-token-budget: got 100"),
    (["run", "tierkv-sparse", "{d}", "{d}", "--sparse-token-budget", "96", "--sparse-block-tokens", "64"],
     "--sparse-token-budget: got 96; a positive multiple of --sparse-block-tokens (64)"),
    (["run", "tierkv-sparse", "{d}", "{d}", "--sparse-block-tokens", "48"], "--sparse-block-tokens: got 48; a power of two"),
    (["run", "tierkv-sparse", "{d}", "{d}", "--contexts", "2048,3000", "--tag", "x"], "--contexts: got [3000]; the grid's lengths are"),
    (["run", "tierkv-sparse", "{d}", "{d}", "--contexts", "2048"], "--contexts: needs --tag"),
    (["run", "tierkv-sparse", "{d}", "{d}", "--contexts", "2k"], "argument --contexts: got '2k'; comma-separated"),
    (["run", "tierkv-sparse", "{d}", "{d}", "--tag", "../x"], "--tag: got '../x'; letters, digits"),
    (["all", "{d}/m.gguf", "{d}", "--timeout-s", "0"], "--timeout-s: got 0.0; must be positive"),
    (["run", "plain", "{d}"], "the following arguments are required: out_dir"),
])
def test_bad_arguments_are_refused(tmp_path, capsys, argv, message):
    _checkpoint(tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"x")
    with pytest.raises(SystemExit) as exit_:
        vllm_accuracy.parse_args([a.format(d=tmp_path) for a in argv])
    assert exit_.value.code == 2
    assert message.format(d=tmp_path) in capsys.readouterr().err


def test_run_steps_goes_on_past_a_failing_and_a_hanging_step():
    python = sys.executable
    done = vllm_accuracy.run_steps([([python, "-c", "raise SystemExit(3)"], 30),
                                    ([python, "-c", "import time; time.sleep(60)"], 1),
                                    ([python, "-c", "pass"], 30)])
    assert [d["rc"] for d in done] == [3, "timeout", 0]
    assert done[1]["wall_s"] < 30
