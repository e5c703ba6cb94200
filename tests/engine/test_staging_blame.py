"""A staging ring too small for its lookahead names the key to change: `staging_bytes` when no useful lookahead would
fit it, `lookahead_layers` when the lookahead is past the model's layers and a useful one would fit."""
from __future__ import annotations

import pytest

from tests.models import build
from tierkv.config import ConfigError, load_config
from tierkv.llm import TieredLLM

BLOCK_BYTES = 2 * 2 * 4 * 16 * 4  # K and V, 2 KV heads, 4 tokens, head_dim 16, float32


def _config(lookahead: int, staging_blocks: float) -> dict:
    return {"model": {"name": "staging-blame"},
            "cache": {"block_tokens": 4, "gpu_budget_bytes": 2 * 6 * BLOCK_BYTES, "sink_tokens": 4, "window_tokens": 8},
            "tiers": [{"kind": "cpu", "capacity_bytes": 64 * BLOCK_BYTES}],
            "scheduler": {"lookahead_layers": lookahead, "staging_bytes": int(staging_blocks * BLOCK_BYTES)}}


@pytest.mark.parametrize("lookahead, staging_blocks, key", [
    (2, 0.001, "scheduler.staging_bytes"),  # 1 byte-ish: not even lookahead 1 fits: the ring is what to grow
    (2, 1, "scheduler.staging_bytes"),
    (3, 2, "scheduler.lookahead_layers"),  # lookahead 1 (all a 2-layer model uses) fits 2 blocks: lookahead is wrong
    (2, 2, "scheduler.lookahead_layers"),
])
def test_the_key_named_is_the_one_whose_change_fixes_it(lookahead, staging_blocks, key):
    model, _ = build("llama", num_layers=2)
    with pytest.raises(ConfigError, match=key):
        TieredLLM(model, load_config(_config(lookahead, staging_blocks), env={}), show_progress=False)


@pytest.mark.parametrize("lookahead, staging_blocks", [(2, 64), (1, 2)])
def test_the_fix_each_names_runs(lookahead, staging_blocks):
    model, _ = build("llama", num_layers=2)
    with TieredLLM(model, load_config(_config(lookahead, staging_blocks), env={}), show_progress=False) as llm:
        (out,) = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9]], max_new_tokens=2)
    assert len(out.token_ids) == 2
