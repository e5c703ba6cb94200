"""Blocks of different weights never mix: the configured name and a digest of the weights are in
every block address; the same weights reloaded still reuse blocks across runtimes."""
from __future__ import annotations

import pytest
import torch

from tests.models import build, reference_greedy
from tierkv.config import load_config
from tierkv.llm import TieredLLM
from tierkv.model_identity import checkpoint_identity, files_digest, weights_digest

BLOCK_BYTES = 2 * 2 * 4 * 16 * 4  # K+V, 2 kv heads, 4 tokens, head_dim 16, fp32


def llm_for(model, disk_dir, name: str) -> TieredLLM:
    config = load_config({
        "model": {"name": name},
        "storage": {"secret": "model-identity-test-secret"},  # one deployment secret: only the model differs
        "cache": {"block_tokens": 4, "gpu_budget_bytes": 2 * 6 * BLOCK_BYTES, "sink_tokens": 4, "window_tokens": 8},
        "tiers": [{"kind": "cpu", "capacity_bytes": 50 * BLOCK_BYTES},  # one request at a time
                  {"kind": "disk", "path": str(disk_dir), "capacity_bytes": "64MiB"}],
        "scheduler": {"lookahead_layers": 1, "staging_bytes": 2 * 4 * BLOCK_BYTES, "prefill_chunk_tokens": 64},
    }, env={})
    return TieredLLM(model, config, show_progress=False)


FILLERS = [torch.randint(0, 512, (83,), generator=torch.Generator().manual_seed(s)).tolist() for s in (98, 99)]


def run(model, disk_dir, name: str, prompt: list[int]):
    """`prompt`'s output and the stats, after two more requests pushed its blocks to the disk tier."""
    with llm_for(model, disk_dir, name) as llm:
        (out,) = llm.generate([prompt], max_new_tokens=6)
        llm.generate(FILLERS, max_new_tokens=1)
        llm.runtime.chain.flush()
        return out, llm.stats()


@pytest.mark.parametrize("second_name", ["model-b", "model-a"])  # different names, and one name for both
def test_two_same_shape_models_sharing_a_disk_dir_keep_their_own_tokens(tmp_path, second_name):
    model_a, ref_a = build("llama", seed=1)
    model_b, ref_b = build("llama", seed=2)
    prompt = torch.randint(0, 512, (83,), generator=torch.Generator().manual_seed(0)).tolist()
    shared = tmp_path / "shared"
    out_a, _ = run(model_a, shared, "model-a", prompt)
    out_b, stats_b = run(model_b, shared, second_name, prompt)
    fresh_b, _ = run(model_b, tmp_path / "fresh", second_name, prompt)
    assert out_a.token_ids == reference_greedy(ref_a, prompt, 6)[0]
    assert out_b.token_ids == reference_greedy(ref_b, prompt, 6)[0] == fresh_b.token_ids
    assert out_b.stats["prefix_tokens"] == 0  # nothing of model A's was taken
    assert stats_b["model"]["weights_fingerprint"] is not None


def test_the_same_weights_reloaded_reuse_blocks_across_runtimes(tmp_path):
    prompt = torch.randint(0, 512, (83,), generator=torch.Generator().manual_seed(0)).tolist()
    model, ref = build("llama", seed=3)
    first, stats_1 = run(model, tmp_path / "shared", "model-a", prompt)
    reloaded, _ = build("llama", seed=3)  # a new object, the same weights
    second, stats_2 = run(reloaded, tmp_path / "shared", "model-a", prompt)
    assert second.stats["prefix_tokens"] == 80 and second.stats["prefix_blocks_by_tier"].get("disk", 0) > 0
    assert second.token_ids == first.token_ids == reference_greedy(ref, prompt, 6)[0]
    assert stats_1["model"] == {**stats_2["model"], "fingerprint_s": stats_1["model"]["fingerprint_s"]}


def test_one_changed_layer_changes_the_weights_digest():
    model, _ = build("llama", seed=4)
    before = weights_digest(model)
    assert weights_digest(model) == before  # deterministic
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1.01)
    after = weights_digest(model)
    assert after != before
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.div_(1.01)
        model.model.layers[0].self_attn.k_proj.weight.copy_(torch.randn_like(model.model.layers[0].self_attn.k_proj.weight))
    assert weights_digest(model) not in (before, after)
    other, _ = build("llama", seed=5)
    assert weights_digest(other) != before


def test_a_changed_config_or_buffer_changes_the_digest():
    a, _ = build("llama", seed=6)
    b, _ = build("llama", seed=6)
    assert weights_digest(a) == weights_digest(b)
    b.config.rms_norm_eps = 1e-3  # no weight changed, the KV does
    assert weights_digest(a) != weights_digest(b)


HARMLESS_EDITS = {"eos_token_id": 511, "bos_token_id": 510, "pad_token_id": 509, "use_cache": False,
                  "tie_word_embeddings": True, "output_hidden_states": True,
                  "architectures": ["Other"], "id2label": {0: "x"}}


@pytest.mark.parametrize("field", sorted(HARMLESS_EDITS))
def test_a_config_edit_that_cannot_change_the_kv_keeps_the_runtime_serving(tmp_path, field):
    """Token ids, cache / output flags, the head's tying, names: none reaches the keys and values, so the
    blocks stay valid and the next request runs (the same tokens) instead of refusing the model forever."""
    model, reference = build("llama", seed=7)
    prompt = list(range(5, 30))
    expected, _ = reference_greedy(reference, prompt, 6)
    with llm_for(model, tmp_path, "m") as llm:
        setattr(model.config, field, HARMLESS_EDITS[field])
        (out,) = llm.generate([prompt], max_new_tokens=6)
        (again,) = llm.generate([prompt], max_new_tokens=6)
    assert out.token_ids == again.token_ids == expected
    assert again.stats["prefix_tokens"] > 0  # the blocks of the first request still serve


@pytest.mark.parametrize("field,value", [("rms_norm_eps", 1e-3), ("rope_parameters", {"rope_type": "default",
                                                                                     "rope_theta": 500000.0})])
def test_a_config_edit_that_can_change_the_kv_is_refused_by_name(tmp_path, field, value):
    model, _ = build("llama", seed=7)
    with llm_for(model, tmp_path, "m") as llm:
        setattr(model.config, field, value)
        with pytest.raises(ValueError, match=rf"the model's config changed after .* \({field}\)"):
            llm.generate([[5, 6, 7, 8]], max_new_tokens=2)


def test_same_weights_under_other_names_do_not_share(tmp_path):
    prompt = torch.randint(0, 512, (43,), generator=torch.Generator().manual_seed(0)).tolist()
    model, _ = build("llama", seed=7)
    run(model, tmp_path / "shared", "model-a", prompt)
    out, stats = run(model, tmp_path / "shared", "model-b", prompt)
    assert out.stats["prefix_tokens"] == 0 and stats["model"]["name"] == "model-b"


def test_checkpoint_files_digest_sees_any_sampled_change(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"hidden_size": 64}')
    weights = ckpt / "model.safetensors"
    weights.write_bytes(bytes(range(256)) * 40000)  # 10 MB: sampled, not read whole
    base = checkpoint_identity("m", ckpt)
    assert base.weights == checkpoint_identity("m", ckpt).weights and base.weights == files_digest(ckpt)
    data = bytearray(weights.read_bytes())
    data[0] ^= 1  # the head of a safetensors file is its header: always read
    weights.write_bytes(bytes(data))
    assert files_digest(ckpt) != base.weights
    (ckpt / "config.json").write_text('{"hidden_size": 65}')
    assert checkpoint_identity("m", ckpt).key != base.key
    assert checkpoint_identity("other", ckpt).key != checkpoint_identity("m", ckpt).key
    assert checkpoint_identity("m", ckpt, revision="v2").key != checkpoint_identity("m", ckpt).key


def test_the_fingerprints_are_in_stats_and_the_prometheus_exposition(tmp_path):
    prometheus_client = pytest.importorskip("prometheus_client")
    from tierkv.metrics.prometheus import TierKVCollector, new_registry
    from tierkv.metrics.snapshot import flatten_stats

    model, _ = build("llama", seed=8)
    with llm_for(model, tmp_path / "disk", "model-x") as llm:
        stats = llm.stats()
        text = prometheus_client.generate_latest(new_registry(TierKVCollector(lambda: flatten_stats(llm.stats())))).decode()
    info = stats["model"]
    assert info["name"] == "model-x" and info["weights_fingerprint"] == weights_digest(model)
    assert info["block_fingerprint"] == llm.runtime.fingerprint and info["fingerprint_s"] >= 0
    (line,) = [x for x in text.splitlines() if x.startswith("tierkv_model_info{")]
    for key in ("name", "weights_fingerprint", "block_fingerprint"):
        assert f'{key}="{info[key]}"' in line


def test_a_hub_id_is_digested_from_where_it_was_downloaded_or_named_with_a_warning(tmp_path, caplog, monkeypatch):
    """vLLM's download_dir is a hub cache of its own: the weights there are digested (they were named by
    the hub id alone, so two hosts holding other snapshots of it would share blocks); a hub id found
    nowhere keeps its name and revision alone and says so."""
    import logging

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    commit = "0" * 39 + "1"
    repo = tmp_path / "downloads" / "models--org--tiny"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"num_hidden_layers": 2}')
    (snapshot / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    found = checkpoint_identity("m", "org/tiny", cache_dir=tmp_path / "downloads")
    assert found.weights == files_digest(snapshot)
    (snapshot / "model.safetensors").write_bytes(bytes(range(255, -1, -1)) * 8)  # another snapshot's weights
    assert checkpoint_identity("m", "org/tiny", cache_dir=tmp_path / "downloads").key != found.key
    with caplog.at_level(logging.WARNING, logger="tierkv.model_identity"):
        nowhere = checkpoint_identity("m", "org/tiny")
    assert nowhere.weights is None and any("addressed by its name alone" in r.getMessage() for r in caplog.records)
