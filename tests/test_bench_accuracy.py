"""bench_accuracy --quick on the real model: exact mode gives transformers' tokens, dense retrieval finds
the key; the summary counts accuracy and missed depths per mode."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_accuracy


@pytest.mark.real_model
def test_quick_run_exact_tokens_identical_and_dense_finds_the_key(tmp_path):
    out = tmp_path / "accuracy.json"
    record = bench_accuracy.main(["--quick", "--out", str(out), "--disk-path", str(tmp_path / "disk")])
    assert json.loads(out.read_text()) == record
    assert record["command"] and record["date"] and record["device"].startswith("cpu")
    exact = record["results"]["exact"]
    assert exact and all(row.get("identical") is True for row in exact), exact
    assert all(row["max_abs_logit_diff"] < 1e-2 for row in exact)
    dense = [r for r in record["results"]["retrieval"] if r["mode"] == "dense"]
    assert dense and all(r["correct"] for r in dense), dense
    modes = {r["mode"] for r in record["results"]["retrieval"]}
    assert modes == {"dense", "exact", "sparse"}
    recall = record["results"]["recall"]  # one row per case and sparse budget, one value per layer
    assert [(r["task"], r["token_budget"]) for r in recall] == [("passkey", 128)]
    values = [v for v in recall[0]["recall"] if v is not None]
    assert len(recall[0]["recall"]) == 30 and values and all(0.0 <= v <= 1.0 + 1e-6 for v in values)


def test_summary_counts_accuracy_errors_and_missed_depths():
    base = {"task": "passkey", "context_tokens": 2048, "mode": "sparse", "token_budget": 256, "predictor": "none"}
    rows = [{**base, "depth": 0.0, "correct": True}, {**base, "depth": 0.5, "correct": False},
            {**base, "depth": 1.0, "error": "ValueError: x"}, {**base, "mode": "dense", "depth": 0.5, "correct": True}]
    summary = {r["mode"]: r for r in bench_accuracy.summarize_retrieval(rows)}
    assert summary["sparse"]["accuracy"] == 0.5 and summary["sparse"]["errors"] == 1
    assert summary["sparse"]["missed_depths"] == [0.5] and summary["sparse"]["cases"] == 3
    assert summary["dense"]["accuracy"] == 1.0 and summary["dense"]["missed_depths"] == []


@pytest.mark.parametrize("argv, message", [(["--parts", "exact,speed"], "--parts: got 'speed'"),
                                           (["--tasks", "haystack"], "--tasks: got 'haystack'")])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_accuracy.parse_args(argv)
    assert message in capsys.readouterr().err


# -- selection recall (benchmarks/accuracy_recall.py) ------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from benchmarks import accuracy_recall  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(block_tokens=st.sampled_from([1, 4, 16]), extra_slots=st.integers(0, 20), sink_tokens=st.integers(0, 40),
       window_tokens=st.integers(0, 80), t0=st.integers(0, 2000))
def test_far_layout_is_tierkv_residency_and_step_blocks(block_tokens, extra_slots, sink_tokens, window_tokens, t0):
    """The layout the recall scores against is the one tierkv's sparse decode reads: the same front and
    window split of the GPU budget (plan_residency) and the same far candidates (step_blocks, n = 1)."""
    from tierkv.blocks import BlockLayout
    from tierkv.config import load_config
    from tierkv.scheduler.plan import step_blocks
    from tierkv.storage.gpu import plan_residency

    num_layers, num_kv_heads, head_dim = 3, 2, 8
    layout = BlockLayout(block_tokens=block_tokens, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=torch.float32)
    needed = -(-sink_tokens // block_tokens) + -(-window_tokens // block_tokens) + 1
    budget = (needed + extra_slots) * layout.num_bytes * num_layers
    config = load_config({"cache": {"block_tokens": block_tokens, "gpu_budget_bytes": budget,
                                    "sink_tokens": sink_tokens, "window_tokens": window_tokens}}, env={})
    ours = accuracy_recall.FarLayout.of_config(config, num_layers, num_kv_heads, head_dim, 4)
    residency = plan_residency(layout, num_layers, budget, sink_tokens, window_tokens)
    assert (ours.num_front_blocks, ours.num_window_blocks) == (residency.num_front_blocks, residency.num_window_blocks)
    assert ours.far_blocks(t0) == step_blocks(residency, block_tokens, t0, 1)[1]


def test_far_layout_refuses_a_budget_tierkv_refuses():
    from tierkv.config import load_config

    bytes_per_block = 2 * 2 * 16 * 8 * 4 * 3  # K and V, 2 KV heads, 16 tokens, head_dim 8, float32, 3 layers
    config = load_config({"cache": {"block_tokens": 16, "gpu_budget_bytes": 16 * bytes_per_block,
                                    "sink_tokens": 16, "window_tokens": 256}}, env={})
    with pytest.raises(ValueError, match="holds 16 blocks per layer"):
        accuracy_recall.FarLayout.of_config(config, 3, 2, 8, 4)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), num_far=st.integers(2, 12), k=st.integers(1, 12), t0_extra=st.integers(0, 40))
def test_step_recall_bounds_and_definitions(seed, num_far, k, t0_extra):
    """recall, oracle recall, far and dropped mass against a direct computation; the oracle is never
    below the selection's; selecting every far block holds all of their mass."""
    g = torch.Generator().manual_seed(seed)
    T, heads, kv_heads, D = 4, 6, 2, 8
    far = range(2, 2 + num_far)
    t0 = far.stop * T + t0_extra
    q = torch.randn(heads, D, generator=g) * 2
    keys = torch.randn(kv_heads, t0 + 1, D, generator=g)
    k = min(k, num_far)
    selected = sorted(torch.randperm(num_far, generator=g)[:k].add(far.start).tolist())
    row = accuracy_recall.step_recall(q, keys, 0.5, t0, far, selected, T, needle_blocks=set())
    probs = torch.softmax(torch.einsum("hd,htd->ht", q, keys.repeat_interleave(heads // kv_heads, 0)) * 0.5, -1)
    in_far = probs[:, far.start * T : far.stop * T].sum(-1)
    in_sel = sum(probs[:, b * T : (b + 1) * T].sum(-1) for b in selected)
    assert row["recall"] == pytest.approx(float((in_sel / in_far).mean()), rel=1e-4)
    assert row["far_mass"] == pytest.approx(float(in_far.mean()), rel=1e-4)
    assert row["dropped_mass"] == pytest.approx(float((in_far - in_sel).mean()), abs=1e-6)
    assert 0.0 <= row["recall"] <= row["oracle_recall"] + 1e-6 <= 1.0 + 2e-6
    assert row["needle_selected"] is None
    every = accuracy_recall.step_recall(q, keys, 0.5, t0, far, list(far), T, needle_blocks={far.start, 0})
    assert every["recall"] == pytest.approx(1.0) and every["dropped_mass"] == pytest.approx(0.0, abs=1e-6)
    assert every["needle_selected"] is True  # block 0 is front, not far: only far needle blocks count


def test_needle_missed_when_a_far_needle_block_is_not_selected():
    q, keys = torch.zeros(2, 4), torch.zeros(1, 64, 4)
    row = accuracy_recall.step_recall(q, keys, 1.0, 63, range(1, 10), [1, 2], 4, needle_blocks={2, 5})
    assert row["needle_selected"] is False
    assert row["recall"] == pytest.approx(2 / 9)  # uniform attention: 2 of 9 equal far blocks


def test_capture_decode_rebuilds_each_layers_attention_and_keeps_dense_tokens():
    """The captured queries (after rotary) and the cache's keys give back each layer's attention output
    at every decode step (softmax(q k^T scale) v against the module's input to o_proj), and the tokens
    are dense_greedy's: the recall is computed from the attention the model ran."""
    from tests.models import build
    from tierkv.longdoc import dense_greedy

    model, _ = build("llama", num_heads=4, num_kv_heads=2, head_dim=16, num_layers=3, seed=3)
    prompt = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    outputs: list[list[torch.Tensor]] = []
    # per forward, each layer's attention output at the last position (the input of o_proj)
    step_counter = model.model.layers[0].register_forward_pre_hook(lambda mod, args: outputs.append([]))
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(lambda mod, args: outputs[-1].append(args[0][0, -1]))
             for layer in model.model.layers]
    try:
        capture = accuracy_recall.capture_decode(model, prompt, 6, set(), chunk_tokens=32)
    finally:
        for h in hooks + [step_counter]:
            h.remove()
    assert capture.tokens == dense_greedy(model, prompt, 6, set(), chunk_tokens=32)[0]
    decode_outputs = outputs[-len(capture.queries):]  # the prefill chunks came first
    assert len(capture.queries) == 5 and capture.positions == list(range(70, 75))
    values = _cache_values(model, prompt, capture.tokens)
    for step, (t0, queries) in enumerate(zip(capture.positions, capture.queries)):
        for layer, q in enumerate(queries):
            k = capture.keys[layer][:, : t0 + 1].repeat_interleave(2, 0)
            v = values[layer][:, : t0 + 1].repeat_interleave(2, 0)
            probs = torch.softmax(torch.einsum("hd,htd->ht", q, k) * capture.scale, -1)
            rebuilt = torch.einsum("ht,htd->hd", probs, v).reshape(-1)
            torch.testing.assert_close(rebuilt, decode_outputs[step][layer], rtol=1e-4, atol=1e-5)


def _cache_values(model, prompt, tokens):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt + tokens[:-1]]), **accuracy_recall.cache_kwargs(model, cache))
    return [layer.values[0].float() for layer in cache.layers]


def test_needle_positions_finds_every_occurrence():
    assert accuracy_recall.needle_positions([5, 1, 2, 7, 1, 2], [1, 2]) == [1, 2, 4, 5]
    assert accuracy_recall.needle_positions([5, 1, 3], [1, 2]) == []
    assert accuracy_recall.needle_positions([1], []) == []


def test_recall_summary_means_per_layer_over_cases_and_names_lowest_layers():
    base = {"task": "passkey", "context_tokens": 2048, "token_budget": 256}
    fields = {f: [0.5, None] for f in accuracy_recall.FIELDS}
    rows = [{**base, **fields, "recall": [0.2, 0.9]}, {**base, **fields, "recall": [0.4, None]},
            {**base, "token_budget": 512, **fields, "recall": [1.0, 1.0]},
            {**base, "task": "realtext", **fields, "recall": [0.0, 0.0]}]
    summary = {s["token_budget"]: s for s in accuracy_recall.summarize_recall(rows) if s["task"] == "passkey"}
    assert summary[256]["cases"] == 2 and summary[256]["recall"] == [pytest.approx(0.3), pytest.approx(0.9)]
    assert summary[256]["mean_recall"] == pytest.approx(0.6) and summary[256]["lowest_recall_layers"] == [0, 1]
    assert summary[256]["far_mass"] == [0.5, None] and summary[512]["mean_recall"] == 1.0


def test_retrieval_table_compares_each_mode_with_dense_on_the_same_cases():
    from benchmarks import accuracy_table

    def row(mode, depth, correct, text, budget=None, predictor=None):
        return {"task": "passkey", "context_tokens": 2048, "depth": depth, "seed": 0, "mode": mode,
                "token_budget": budget, "predictor": predictor, "correct": correct, "text": text}

    rows = [row("dense", 0.0, True, "1"), row("dense", 0.5, False, "9"),
            row("sparse", 0.0, False, "2", 256, "none"), row("sparse", 0.5, False, "9", 256, "none"),
            {**row("sparse", 1.0, True, "x", 256, "none"), "correct": None} | {"error": "E"}]
    del rows[-1]["correct"]
    lines = accuracy_table.retrieval_table(rows)
    sparse = next(line for line in lines if "| sparse |" in line)
    # 3 cases (one error); of the 2 scored, 0% found against dense's 50% on the same cases; 1 of 2 texts equal
    assert "| 3 | 1 | 0% | 50% | -50 | 50% | passkey@0, passkey@0.5 |" in sparse


@pytest.mark.real_model
def test_a_spent_time_limit_starts_no_case_and_the_json_says_which_were_not_run(tmp_path):
    out = tmp_path / "accuracy.json"
    record = bench_accuracy.main(["--quick", "--time-limit-s", "0", "--out", str(out),
                                  "--disk-path", str(tmp_path / "disk")])
    results = record["results"]
    assert results["exact"] == [] and results["retrieval"] == []
    assert results["stopped_early"] == {"time_limit_s": 0.0,
                                        "first_cases_not_run": ["exact 512", "retrieval passkey 512 depth 0.5 seed 0"]}
    assert bench_accuracy.DEADLINE is None  # the limit was that run's: a later run in this process has none
