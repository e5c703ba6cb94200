"""Config: YAML and environment in, typed dataclasses out; every bad value names its key."""
from __future__ import annotations

from pathlib import Path

import pytest

from tierkv.config import ConfigError, load_config
from tierkv.units import parse_bytes

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["default.yaml", "long-128k.yaml", "redis.yaml", "vllm-128k.yaml",
                                  "vllm-128k-sparse.yaml", "long-128k-sparse.yaml"])
def test_shipped_configs_load(name):
    config = load_config(CONFIGS / name, env={})
    assert config.tiers[0].kind == "cpu"
    assert config.cache.gpu_budget_bytes > 0


def test_the_sparse_transformers_config_fits_two_gib_for_the_8b_shape():
    """configs/long-128k-sparse.yaml (bench_sparse.py's settings with predictor 'cache'): the resident
    blocks hold sinks and window, staging holds the caches of 4 selections and the margin fits beside a
    selection, and with the key summaries of a 128k request the GPU memory for KV is 2 GiB."""
    import torch

    from tierkv.blocks import BlockLayout
    from tierkv.sparse.predict_cache import check_staging
    from tierkv.storage.gpu import plan_residency
    from tierkv.sparse.prefetch_margin import check_margin

    config = load_config(CONFIGS / "long-128k-sparse.yaml", env={})
    cache, sched, model = config.cache, config.scheduler, config.model
    assert (sched.policy, sched.predictor) == ("sparse", "cache")
    layout = BlockLayout(model.num_kv_heads, cache.block_tokens, model.head_dim, torch.bfloat16)
    plan = plan_residency(layout, model.num_layers, cache.gpu_budget_bytes, cache.sink_tokens, cache.window_tokens)
    assert plan.num_front_blocks >= 1  # the sink block, and the rest a resident far-block cache
    k = sched.sparse_token_budget // cache.block_tokens
    check_staging(model.num_layers, sched.staging_bytes // layout.num_bytes, k, sched.sparse_cache_selections,
                  layout.num_bytes)
    check_margin(sched.sparse_prefetch_margin, k, sched.sparse_cache_selections * k, per_layer=True)
    summaries = 2 * model.num_kv_heads * model.head_dim * 2 * (131072 // cache.block_tokens) * model.num_layers
    assert cache.gpu_budget_bytes + sched.staging_bytes + summaries == 2 * 2**30


def test_units_and_env_overrides():
    env = {"TIERKV_CACHE__GPU_BUDGET_BYTES": "512MiB", "TIERKV_TIERS__1__CAPACITY_BYTES": "3 GB",
           "TIERKV_SCHEDULER__LOOKAHEAD_LAYERS": "4"}
    config = load_config(CONFIGS / "long-128k.yaml", env=env)
    assert config.cache.gpu_budget_bytes == 512 * 2**20
    assert config.tiers[1].capacity_bytes == 3 * 10**9
    assert config.scheduler.lookahead_layers == 4
    assert config.cache.block_tokens == 64  # untouched keys keep the file's value


def test_config_file_from_environment():
    config = load_config(None, env={"TIERKV_CONFIG_FILE": str(CONFIGS / "redis.yaml")})
    assert [t.kind for t in config.tiers] == ["cpu", "redis"]


def test_defaults_without_any_file():
    config = load_config(None, env={})
    assert config.scheduler.policy == "exact" and config.tiers[0].kind == "cpu"


@pytest.mark.parametrize("text,expected", [("2GiB", 2 * 2**30), ("1.5 KiB", 1536), ("10MB", 10**7), (4096, 4096),
                                           ("1.005KB", 1005), ("1.001 KB", 1001), ("0.3GB", 3 * 10**8)])
def test_parse_bytes(text, expected):  # decimal sizes read exactly (1.005 * 1000 is 1004.99... in floating point)
    assert parse_bytes(text) == expected


BAD = [
    ({"cache": {"gpu_budgt_bytes": 1}}, "cache.gpu_budgt_bytes", "did you mean 'gpu_budget_bytes'"),
    ({"cach": {}}, "cach", "did you mean 'cache'"),
    ({"cache": {"gpu_budget_bytes": "2 gigs"}}, "cache.gpu_budget_bytes", "GiB"),
    ({"cache": {"gpu_budget_bytes": "1.5B"}}, "cache.gpu_budget_bytes", "units"),
    ({"cache": {"gpu_budget_bytes": 0}}, "cache.gpu_budget_bytes", "positive"),
    ({"cache": {"block_tokens": -16}}, "cache.block_tokens", "positive"),
    ({"cache": {"sink_tokens": -1}}, "cache.sink_tokens", "at least 0"),
    ({"cache": {"block_tokens": "sixteen"}}, "cache.block_tokens", "integer"),
    ({"cache": {"block_tokens": True}}, "cache.block_tokens", "integer"),
    ({"tiers": [{"kind": "cpu", "capacity_bytes": -5}]}, "tiers[0].capacity_bytes", "positive"),
    ({"tiers": [{"kind": "cpu", "capacty_bytes": 5}]}, "tiers[0].capacty_bytes", "did you mean 'capacity_bytes'"),
    ({"tiers": [{"kind": "gpu"}]}, "tiers[0].kind", "cpu, disk, redis"),
    ({"tiers": [{"capacity_bytes": 5}]}, "tiers[0].kind", "cpu, disk, redis"),
    ({"tiers": [{"kind": "disk", "path": "/tmp"}]}, "tiers", "first tier must be kind 'cpu'"),
    ({"tiers": []}, "tiers", "first tier must be kind 'cpu'"),
    ({"tiers": "cpu"}, "tiers", "list of tiers"),
    ({"tiers": [{"kind": "cpu"}, {"kind": "disk", "path": "/proc/1/tierkv"}]}, "tiers[1].path", "writable"),
    ({"tiers": [{"kind": "cpu"}, {"kind": "disk", "path": "/etc/hostname/x"}]}, "tiers[1].path", "not one"),
    ({"tiers": [{"kind": "cpu"}, {"kind": "redis", "url": "http://h:6379"}]}, "tiers[1].url", "redis://"),
    ({"tiers": [{"kind": "cpu"}, {"kind": "redis", "url": "redis://h:99999"}]}, "tiers[1].url", "redis://"),
    ({"tiers": [{"kind": "cpu"}, {"kind": "redis", "url": "redis://h:6379/zero"}]}, "tiers[1].url", "database"),
    ({"tiers": [{"kind": "cpu"}, {"kind": "redis", "url": "redis:///0"}]}, "tiers[1].url", "redis://"),
    ({"tiers": [{"kind": "cpu"}, {"kind": "redis", "ttl_s": 0}]}, "tiers[1].ttl_s", "positive"),
    ({"tiers": [{"kind": "cpu"}, {"kind": "redis", "namespace": ""}]}, "tiers[1].namespace", "non-empty"),
    ({"tiers": [{"kind": "cpu", "storage_dtype": "fp4"}]}, "tiers[0].storage_dtype", "allowed: auto"),
    ({"scheduler": {"policy": "magic"}}, "scheduler.policy", "allowed: exact, sparse"),
    ({"scheduler": {"lookahead_layers": 0}}, "scheduler.lookahead_layers", "positive"),
    ({"scheduler": {"sparse_graph_rows": 0}}, "scheduler.sparse_graph_rows", "positive"),
    ({"metrics": {"prometheus_port": 70000}}, "metrics.prometheus_port", "at most 65535"),
    ({"metrics": {"enabled": "yes please"}}, "metrics.enabled", "true or false"),
    ({"model": {"kv_dtype": "int3"}}, "model.kv_dtype", "bfloat16"),
    ({"model": "llama"}, "model", "mapping"),
]


@pytest.mark.parametrize("data,key,allowed", BAD, ids=[b[1] + ":" + str(i) for i, b in enumerate(BAD)])
def test_bad_values_name_key_value_and_what_is_allowed(data, key, allowed):
    with pytest.raises(ConfigError) as info:
        load_config(data, env={})
    message = str(info.value)
    assert f"'{key}'" in message
    assert allowed in message
    assert info.value.key == key


def test_bad_env_override_names_the_variable():
    with pytest.raises(ConfigError, match="TIERKV_CACHE__BLOCK_TOKENS") as info:
        load_config(None, env={"TIERKV_CACHE__BLOCK_TOKENS": "0"})
    assert "cache.block_tokens" in str(info.value)
    with pytest.raises(ConfigError, match="did you mean 'window_tokens'"):
        load_config(None, env={"TIERKV_CACHE__WINDOW_TOKEN": "8"})
    with pytest.raises(ConfigError, match="TIERKV_TIERS__5__PATH"):
        load_config(None, env={"TIERKV_TIERS__5__PATH": "/tmp"})


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="config_file"):
        load_config(tmp_path / "nope.yaml", env={})
    broken = tmp_path / "broken.yaml"
    broken.write_text("cache: [unclosed\n")
    with pytest.raises(ConfigError, match="valid YAML"):
        load_config(broken, env={})


@pytest.mark.parametrize("text", ["", "\n\n", "   \n \n", "\ufeff"])
def test_an_empty_file_is_refused_not_read_as_the_defaults(tmp_path, text):
    """A file with nothing in it (truncated, or never written) is not a choice of the defaults."""
    empty = tmp_path / "empty.yaml"
    empty.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match="the file is empty"):
        load_config(empty, env={})


@pytest.mark.parametrize("text", ["{}\n", "# every setting at its default\n", "---\n{}\n"])
def test_an_explicitly_empty_config_is_the_defaults(tmp_path, text):
    chosen = tmp_path / "defaults.yaml"
    chosen.write_text(text)
    assert load_config(chosen, env={}) == load_config(None, env={})


def test_the_shipped_sparse_vllm_config_keeps_a_selection_per_layer_for_an_8b_request():
    """configs/vllm-128k-sparse.yaml as FarKV sizes it for Llama-3.1-8B (32 layers, 8 KV heads of
    128, bf16) as written: one decoding row with a far-block cache per layer, no warning, within its
    staging (more rows: vllm_rows_from_batch raises it, tests/integrations/vllm/test_shipped_configs.py)."""
    from tierkv.sparse.row_caches import cache_rows

    config = load_config(CONFIGS / "vllm-128k-sparse.yaml", env={})
    sched, block_tokens = config.scheduler, config.cache.block_tokens
    k = sched.sparse_token_budget // block_tokens
    block_bytes = 2 * 8 * block_tokens * 128 * 2
    eager = 2 * k * block_bytes  # FarKV's two eager regions of one selection
    rows, per_layer, warning = cache_rows(1, sched.sparse_cache_selections, sched.staging_bytes, eager, 32, k,
                                          block_bytes, 0)
    assert (rows, per_layer, warning) == (1, True, None)
    # four requests at once do not keep selections in the staging as written: the warning says what would
    rows, per_layer, warning = cache_rows(4, sched.sparse_cache_selections, sched.staging_bytes, eager, 32, k,
                                          block_bytes, 0)
    assert (rows, per_layer) == (4, False) and "raise it to" in warning


@pytest.mark.parametrize("raw", ["2 GBs", "x", 1.5, "-3GiB"])
def test_a_bad_size_names_the_units_once_with_their_scales(raw):
    with pytest.raises(ConfigError) as err:
        load_config({"tiers": [{"kind": "cpu", "capacity_bytes": raw}]}, env={})
    text = str(err.value)
    assert "tiers[0].capacity_bytes" in text and text.count("units:") == 1
    assert "powers of 1000" in text and "powers of 1024" in text


def test_a_refused_size_in_bytes_shows_its_units_beside_it():
    err = ConfigError("cache.gpu_budget_bytes", 1 << 20, "at least 4.22 MiB")
    assert "got 1048576 (1.00 MiB);" in str(err)
    assert "got 10;" in str(ConfigError("cache.gpu_budget_bytes", 10, "x"))


def test_a_size_too_large_to_print_in_units_and_a_masked_one_show_no_units():
    huge = ConfigError("scheduler.staging_bytes", 10**400, "must be at most 1024.00 TiB")  # (float() overflows)
    assert str(huge).startswith("config key 'scheduler.staging_bytes': got 1000") and "TiB)" not in str(huge).split(";")[0]
    masked = str(ConfigError("storage.secret_bytes", 987654321, "unknown key"))
    assert "'***'" in masked and "MiB" not in masked and "987" not in masked


@pytest.mark.parametrize("source", [[1, 2], 5, b"default", 1.5, ("default",)])
def test_a_config_source_of_another_type_is_refused_naming_the_argument(source):
    from tierkv.config import config_errors

    for load in (load_config, config_errors):
        with pytest.raises(TypeError, match=rf"config: got {type(source).__name__}; expected a YAML file's path"):
            load(source)
