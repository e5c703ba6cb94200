"""The ratios `benchmarks/bench_vllm.py table` prints: each row against the plain row run beside it
(a tagged repeat against the plain row of its tag), and the spread of repeated rows. No vLLM needed."""
from __future__ import annotations

import json

from benchmarks.bench_vllm import baseline, table


def row(mode: str, ms: float, tag: str = "", tokens: int = 5) -> dict:
    """A finished bench_vllm row: a prefill step, then `tokens - 1` decode steps of `ms` each."""
    return {"mode": mode, "tag": tag, "kv_reserved_bytes": 1 << 30, "prefill_s": 1.0, "decode_ms_per_token": ms,
            "prefix_ttft_first_s": float("nan"), "prefix_ttft_repeat_s": float("nan"), "far_wait_s": 0.0,
            "tokens": list(range(tokens)), "step_ms": [500.0] + [ms] * (tokens - 1)}


def test_a_tagged_row_is_compared_with_the_plain_row_of_its_tag(tmp_path, capsys):
    rows = [row("plain", 10.0), row("plain-r1", 20.0, "r1"), row("tierkv-sparse-graphs-r1", 25.0, "r1"),
            row("tierkv-sparse-graphs-r2", 12.5, "r2"), row("plain@compiled", 5.0),
            row("tierkv-sparse-graphs@compiled-r1", 10.0, "r1")]
    for r in rows:
        (tmp_path / f"bench-vllm-{r['mode'].replace('@', '_')}.json").write_text(json.dumps(r))
    by_mode = {r["mode"]: r for r in rows}
    assert baseline(by_mode, by_mode["tierkv-sparse-graphs-r1"])["mode"] == "plain-r1"   # its neighbour
    assert baseline(by_mode, by_mode["tierkv-sparse-graphs-r2"])["mode"] == "plain"      # no plain-r2
    assert baseline(by_mode, by_mode["tierkv-sparse-graphs@compiled-r1"])["mode"] == "plain@compiled"
    table(str(tmp_path))
    printed = capsys.readouterr().out
    assert "decode tokens/s x plain: 0.80 (means), 0.80 (median steps 25.0 / 20.0 ms)" in printed  # r1 vs plain-r1
    assert "decode tokens/s x plain: 0.80 (means), 0.80 (median steps 12.5 / 10.0 ms)" in printed  # r2 vs plain
    # against plain for both, r1 would read 0.40: the spread shows each against its own baseline
    assert "tierkv-sparse-graphs over 2 runs, decode tokens/s x plain: 0.80-0.80 by the means" in printed
    assert "@compiled over" not in printed  # one compiled run: no spread


def test_the_hit_rate_line_is_the_timed_requests_own_reads(tmp_path, capsys):
    """A sparse row's GPU hit rate: its timed request's reads of window blocks and cache-held far
    blocks over all its reads, with the far blocks fetched at selection and the model it ran."""
    sparse = row("tierkv-sparse-graphs", 10.0)
    sparse["decode_reads"] = {"sparse_resident_reads": 30, "sparse_selected_reads": 40, "cache_hits": 36,
                              "cache_misses": 4, "stalls": 3, "gpu_hit_rate": 66 / 70}
    sparse["model_qk_bias_std"] = 16.0
    sparse["connector"] = {"hot_window": {"selection_overlap": 0.9, "gpu_hit_rate": 0.5}}
    for r in (row("plain", 10.0), sparse):
        (tmp_path / f"bench-vllm-{r['mode']}.json").write_text(json.dumps(r))
    table(str(tmp_path))
    printed = capsys.readouterr().out
    assert ("GPU hit rate at attention time 0.943 (blocks read from the window or a far-block cache over all; "
            "4 of 40 selected far blocks fetched at selection, 3 stalls), selection overlap with the step before "
            "0.900, model q/k bias std 16.0") in printed


def test_drawn_qk_biases_leave_v_and_o_unbiased():
    """The locality model's biases (bench_vllm model --qk-bias-std) on a small Llama: q and k drawn at
    the asked spread, v and o zero."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.models import draw_qk_biases

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, attention_bias=True)
    model = LlamaForCausalLM(config)
    draw_qk_biases(model, 8.0)
    for layer in model.model.layers:
        attn = layer.self_attn
        q, k = attn.q_proj.bias, attn.k_proj.bias
        assert 6.0 < q.std().item() < 10.0 and 5.0 < k.std().item() < 11.0  # 256 and 128 draws of N(0, 64)
        assert not attn.v_proj.bias.any() and not attn.o_proj.bias.any()


def test_the_transformers_benchmark_model_takes_the_same_biases():
    """bench_sparse.py --qk-bias-std: the 8B-shaped model of the transformers engine with q/k biases
    at the asked spread (one layer, bf16 on CPU), and a negative spread refused."""
    import pytest

    from benchmarks.models import llama_8b_shaped

    attn = llama_8b_shaped(num_layers=1, device="cpu", qk_bias_std=16.0).model.layers[0].self_attn
    assert 15.0 < attn.q_proj.bias.float().std().item() < 17.0 and 14.0 < attn.k_proj.bias.float().std().item() < 18.0
    assert not attn.v_proj.bias.any() and not attn.o_proj.bias.any()
    with pytest.raises(ValueError, match="qk_bias_std"):
        llama_8b_shaped(num_layers=1, device="cpu", qk_bias_std=-1.0)


def test_the_slowest_decode_steps_show_tierkvs_host_parts(tmp_path, capsys):
    """A row that recorded, per engine step, the hot window's and the connector's host ms: the table
    names its slowest decode steps with those parts (the rest of a step is vLLM's and the GPU's)."""
    sparse = row("tierkv-sparse-graphs", 10.0, tokens=5)  # a prefill step, then 4 decode steps
    sparse["step_ms"] = [500.0, 10.0, 45.0, 11.0, 10.0]
    sparse["step_far_host_ms"] = [[5.0, 90.0], [0.1, 2.0], [2.5, 8.1], [0.1, 2.1], [0.1, 2.0]]
    sparse["step_connector_ms"] = [[1.0, 9.0, 0.5], [0.2, 0.0, 0.1], [0.3, 1.2, 0.1], [0.2, 0.0, 0.1], [0.2, 0.0, 0.1]]
    for r in (row("plain", 10.0), sparse):
        (tmp_path / f"bench-vllm-{r['mode']}.json").write_text(json.dumps(r))
    table(str(tmp_path))
    printed = capsys.readouterr().out
    assert "slowest decode steps" in printed
    assert "1: 45.0; 2.5/8.1, 0.3/1.2/0.1; 2: 11.0; 0.1/2.1, 0.2/0.0/0.1" in printed  # decode step 1 first


def test_each_repeat_of_the_prefix_is_split_into_add_request_and_engine_steps(tmp_path, capsys):
    r = row("tierkv", 10.0)
    r.update({"prefix_ttft_first_s": 6.0, "prefix_ttft_repeat_s": 0.29, "prefix_ttft_repeat_again_s": 0.27,
              "prefix_ttft_repeat_3_s": 0.26, "prefix_repeat_add_ms": 11.0, "prefix_repeat_step_ms": [279.0],
              "prefix_repeat_again_add_ms": 10.0, "prefix_repeat_again_step_ms": [260.0],
              "prefix_repeat_3_add_ms": 9.5, "prefix_repeat_3_step_ms": [250.5]})
    (tmp_path / "bench-vllm-tierkv.json").write_text(json.dumps(r))
    table(str(tmp_path))
    printed = capsys.readouterr().out
    assert "each repeat's TTFT ms (add_request + engine steps): 290.0 (11.0 + 279.0), 270.0 (10.0 + 260.0), " \
           "260.0 (9.5 + 250.5)" in printed


def test_the_trace_summary_splits_a_step_at_the_copy_engine():
    from benchmarks.trace_summary import summarize
    copy = {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)"}
    events = [{"ph": "X", "ts": 0, "dur": 500, "cat": "cpu_op", "name": "step"},
              {**copy, "ts": 1000, "dur": 2000}, {**copy, "ts": 4000, "dur": 3000},
              {"ph": "X", "ts": 7000, "dur": 1500, "cat": "kernel", "name": "attention"}]
    text = summarize({"traceEvents": events})
    assert ("host-to-device copies: 2, busy 5.00 ms; before the first 1.00 ms, after the last 1.50 ms; idle between "
            "them 1.00 ms in 1 gaps (largest 1.00 ms at 3.0 ms)") in text


def test_each_prefix_set_prints_its_first_run_repeats_and_ratios(tmp_path, capsys):
    """--prefix-gaps rows: one line per prefix, its repeats' TTFT over that prefix's own first run."""
    tierkv = row("tierkv@b64@sets2", 10.0)
    tierkv.update({"prefix_ttft_first_s": 6.0, "prefix_ttft_repeat_s": 0.3, "prefix_ttft_repeat_again_s": 0.24,
                   "prefix_repeat_far_wait_s": 0.25, "prefix_repeat_again_far_wait_s": 0.2,
                   "prefix_ttft_set2_first_s": 5.0, "prefix_ttft_set2_repeat_s": 0.25, "prefix_ttft_set2_repeat_2_s": 0.2,
                   "prefix_set2_repeat_far_wait_s": 0.21, "prefix_set2_repeat_2_far_wait_s": 0.19})
    for r in (row("plain", 10.0), tierkv):
        (tmp_path / f"bench-vllm-{r['mode'].replace('@', '_')}.json").write_text(json.dumps(r))
    table(str(tmp_path))
    printed = capsys.readouterr().out
    assert "prefix 1: first run 6.00 s; repeats 300.0 / 240.0 ms = 0.050 / 0.040x; far wait 250 / 200 ms" in printed
    assert "prefix 2: first run 5.00 s; repeats 250.0 / 200.0 ms = 0.050 / 0.040x; far wait 210 / 190 ms" in printed
