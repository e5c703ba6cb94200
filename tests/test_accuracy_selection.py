"""benchmarks/accuracy_selection.py on the real model (SmolLM2-135M): its rule 'weight' is tierkv's own
sparse decode (the logits of tierkv's TieredCache with the sparse policy, predictor none, at two bound
weights), its oracle rules run, and a too-long context is refused naming the text's length."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf", reason="the real-model extra is not installed (pip install -e '.[real-model]')")


@pytest.fixture(scope="module")
def smollm2():
    from tierkv.model_loading import load_checkpoint

    torch.set_num_threads(2)
    model, tokenizer, _ = load_checkpoint("smollm2-135m", None, "cpu")
    return model, tokenizer


@pytest.mark.parametrize("rule, weight", [("weight", 1.0), ("weight", 0.5), ("kv_group", 0.5)])
def test_the_rules_are_tierkv_sparse_decode(smollm2, tmp_path, rule, weight):
    """Rule 'weight' is tierkv's sparse decode with that bound weight, rule 'kv_group' with
    sparse_selection: per_kv_head (far blocks read in place on the CPU)."""
    from benchmarks.accuracy_selection import check_against_tierkv

    model, tokenizer = smollm2
    # 1024 tokens, GPU budget 1/8: 5 front blocks, 3 window blocks, about 56 far candidates for 8 selected
    assert check_against_tierkv(model, tokenizer, 1024, 6, 128, weight, str(tmp_path), rule) < 1e-3  # 2.7e-5 measured; a wrong weight gives 3.1


def test_oracles_and_rules_run_and_a_too_long_context_is_refused(smollm2, tmp_path):
    from benchmarks.accuracy_selection import parse_args, run

    model, tokenizer = smollm2
    args = parse_args(["--contexts", "1024", "--continuation", "4", "--weights", "1", "--budget-fraction", "8",
                       "--rules", "weight,kv_group,oracle,oracle_head", "--disk-path", str(tmp_path)])
    rows = run(model, tokenizer, args)
    assert [r["rule"] for r in rows] == ["weight", "kv_group", "oracle", "oracle_head"]
    for row in rows:
        assert 0.0 <= row["top1_agreement"] <= 1.0 and row["mean_kl"] >= -1e-6 and row["perplexity_ratio"] > 0
    with pytest.raises(ValueError, match="the text has"):
        run(model, tokenizer, parse_args(["--contexts", "100000", "--disk-path", str(tmp_path)]))


def test_the_adaptive_rules_move_reads_between_kv_heads_at_the_same_total():
    """oracle_kv_adaptive reads k x H_kv (KV head, block) pairs: all of them in the KV head whose query heads
    hold the far mass; kv_adaptive reads as many, scored from the summaries (expanded to the query heads)."""
    from benchmarks.accuracy_selection import _selection, _summaries

    H, num_kv, T, nf, k = 4, 2, 4, 6, 2
    far = range(1, 1 + nf)
    probs = torch.zeros(H, (1 + nf + 1) * T)
    probs[:2, T : T + nf * T] = torch.linspace(1, 2, nf * T)  # KV head 0's query heads: every far block has mass
    probs[2:, 0] = 1.0                                        # KV head 1's: all on the first (front) token
    near = {"scaling": 0.125, "lse": torch.zeros(H)}
    mask = _selection("oracle_kv_adaptive", None, torch.zeros(H, 8), probs, far, k, T, num_kv, near)
    assert mask.dtype == torch.bool and mask.shape == (H, nf)
    assert mask[0].sum() == k * num_kv and not mask[2].any() and torch.equal(mask[0], mask[1])
    assert mask[0].tolist() == [False, False, True, True, True, True]  # the most mass: the last blocks
    keys = torch.randn(num_kv, (1 + nf + 1) * T, 8)
    mask = _selection("kv_adaptive", _summaries(keys, T, 0.5), torch.randn(H, 8), probs, far, k, T, num_kv, near)
    assert mask.shape == (H, nf) and int(mask[::2].sum()) == k * num_kv
    assert torch.equal(mask[0], mask[1]) and torch.equal(mask[2], mask[3])
