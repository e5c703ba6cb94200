"""bench_accuracy's --block-tokens and --sparse-gpu-fraction (benchmarks/accuracy_config.py) reach the
config of every tierkv run: the block size, and with fraction 0 a GPU holding only the sinks and the
window (no front blocks: far blocks from block 0, as vLLM's sparse selection reads them); bad values
are refused naming the option. No model runs: a stand-in with SmolLM2-135M's KV shape."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks import accuracy_recall, bench_accuracy
from tierkv.blocks import BlockLayout
from tierkv.storage.gpu import plan_residency

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M
PROMPT_TOKENS = 2157


class _KvShape(torch.nn.Module):
    """What bench_accuracy._config reads of a model: its config's KV shape and its parameters' dtype."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(num_hidden_layers=NUM_LAYERS, num_key_value_heads=NUM_KV_HEADS,
                                      head_dim=HEAD_DIM, hidden_size=576, num_attention_heads=9)
        self.weight = torch.nn.Parameter(torch.zeros(1))


def _sparse_config(argv: list[str], monkeypatch, tmp_path):
    """The tierkv config of the sparse runs (budget 512, predictor previous) that `main(argv)` would build."""
    for name in ("BLOCK_TOKENS", "SINK_TOKENS", "WINDOW_TOKENS", "SPARSE_FRACTION", "BOUND_WEIGHT", "SELECTION"):
        monkeypatch.setattr(bench_accuracy, name, getattr(bench_accuracy, name))  # main sets them; restored after
    model = _KvShape()

    def configs_only(args):
        kv = bench_accuracy._kv_bytes(model, PROMPT_TOKENS)
        return bench_accuracy._config(model, kv, bench_accuracy.SPARSE_FRACTION, str(tmp_path), "sparse", 512, "previous")

    monkeypatch.setattr(bench_accuracy, "_run", configs_only)
    return bench_accuracy.main(argv)


def _residency(config):
    layout = BlockLayout(block_tokens=config.cache.block_tokens, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                         dtype=torch.float32)
    return plan_residency(layout, NUM_LAYERS, config.cache.gpu_budget_bytes, config.cache.sink_tokens,
                          config.cache.window_tokens)


@pytest.mark.parametrize("block_tokens", [16, 64])
def test_window_only_gives_the_block_size_and_no_front_blocks(block_tokens, monkeypatch, tmp_path):
    config = _sparse_config(["--block-tokens", str(block_tokens), "--sink-tokens", "0", "--window-tokens", "128",
                             "--sparse-gpu-fraction", "0"], monkeypatch, tmp_path)
    assert config.cache.block_tokens == block_tokens
    assert (config.cache.sink_tokens, config.cache.window_tokens) == (0, 128)
    residency = _residency(config)
    assert residency.num_front_blocks == 0 and residency.num_window_blocks == 128 // block_tokens + 1
    assert residency.streamed_range(-(-PROMPT_TOKENS // block_tokens)).start == 0  # far blocks from block 0
    layout = accuracy_recall.FarLayout.of_config(config, NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, 4)  # the recall's too
    assert (layout.block_tokens, layout.num_front_blocks) == (block_tokens, 0)
    scheduler = config.scheduler
    assert (scheduler.policy, scheduler.sparse_token_budget, scheduler.predictor) == ("sparse", 512, "previous")
    block_bytes = 2 * NUM_KV_HEADS * block_tokens * HEAD_DIM * 4
    assert scheduler.staging_bytes >= 2 * NUM_LAYERS * (512 // block_tokens) * block_bytes  # two selections


def test_window_only_keeps_the_sink_blocks_resident(monkeypatch, tmp_path):
    config = _sparse_config(["--block-tokens", "64", "--sink-tokens", "16", "--window-tokens", "128",
                             "--sparse-gpu-fraction", "0"], monkeypatch, tmp_path)
    assert _residency(config).num_front_blocks == 1  # the sink block, nothing past it


def test_defaults_are_unchanged(monkeypatch, tmp_path):
    config = _sparse_config([], monkeypatch, tmp_path)
    kv = PROMPT_TOKENS * 2 * NUM_LAYERS * NUM_KV_HEADS * HEAD_DIM * 4
    assert config.cache.block_tokens == 16 and config.cache.gpu_budget_bytes == kv // 8
    assert (config.cache.sink_tokens, config.cache.window_tokens) == (16, 32)
    assert _residency(config).num_front_blocks > 1


@pytest.mark.parametrize("argv, message", [
    (["--block-tokens", "0"], "--block-tokens: got 0"),
    (["--block-tokens", "-16"], "--block-tokens: got -16"),
    (["--block-tokens", "sixteen"], "--block-tokens"),
    (["--sparse-gpu-fraction", "-1"], "--sparse-gpu-fraction: got -1"),
    (["--sparse-gpu-fraction", "0.5"], "--sparse-gpu-fraction"),
])
def test_bad_cache_options_are_refused_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_accuracy.parse_args(argv)
    assert message in capsys.readouterr().err
