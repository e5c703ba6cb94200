"""One parser of a model's KV shape (`tierkv.model_shape`), used by the vLLM front end (config.json),
the transformers integration (a loaded model's config) and `tierkv plan --model-config`: the same
config gives the same shape through every door, and a bad one a ValueError naming the key."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

from tierkv.cli.plan import load_shape
from tierkv.integrations.vllm.pool_sizing import checkpoint_shape as vllm_checkpoint_shape
from tierkv.model_shape import checkpoint_shape, model_shape

configs = st.fixed_dictionaries(
    {"num_hidden_layers": st.integers(1, 128), "num_attention_heads": st.sampled_from([4, 8, 16, 32]),
     "hidden_size": st.sampled_from([256, 512, 1024, 4096])},
    optional={"num_key_value_heads": st.sampled_from([1, 2, 4]), "head_dim": st.sampled_from([32, 64, 128]),
              "max_position_embeddings": st.integers(1, 1 << 20), "torch_dtype": st.sampled_from(["float32", "bfloat16"]),
              "sliding_window": st.one_of(st.none(), st.integers(1, 8192))},
)


@settings(max_examples=40, deadline=None)
@given(cfg=configs, nested=st.booleans())
def test_every_door_reads_the_same_shape(tmp_path_factory, cfg, nested):
    directory = tmp_path_factory.mktemp("ckpt")
    (directory / "config.json").write_text(json.dumps({"text_config": cfg} if nested else cfg))
    shape = checkpoint_shape(directory)
    heads = cfg["num_attention_heads"]
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (
        cfg["num_hidden_layers"], cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or cfg["hidden_size"] // heads)
    assert shape.sliding_window == cfg.get("sliding_window")
    vllm = vllm_checkpoint_shape(directory)
    assert (vllm["num_hidden_layers"], vllm["num_key_value_heads"], vllm["head_dim"], vllm["dtype_bytes"]) == (
        shape.num_layers, shape.num_kv_heads, shape.head_dim, 4 if cfg.get("torch_dtype") == "float32" else 2)
    if not nested:
        plan = load_shape(str(directory))
        assert (plan.num_layers, plan.num_kv_heads, plan.head_dim) == (shape.num_layers, shape.num_kv_heads, shape.head_dim)
    obj = model_shape(LlamaConfig(**{k: v for k, v in cfg.items() if k != "torch_dtype"}), "object")
    assert (obj.num_layers, obj.num_kv_heads, obj.head_dim) == (shape.num_layers, shape.num_kv_heads, shape.head_dim)


@pytest.mark.parametrize("cfg, message", [
    ({"num_attention_heads": 8, "hidden_size": 512}, "num_hidden_layers=None"),
    ({"num_hidden_layers": 2, "num_attention_heads": 0, "hidden_size": 512}, "num_attention_heads=0"),
    ({"num_hidden_layers": True, "num_attention_heads": 8, "hidden_size": 512}, "num_hidden_layers=True"),
    ({"num_hidden_layers": 2, "num_attention_heads": 8}, "neither head_dim nor hidden_size"),
])
def test_a_bad_config_names_the_key(cfg, message):
    with pytest.raises(ValueError, match=message):
        model_shape(cfg, "config.json")


def test_a_config_json_that_is_not_an_object_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds list, not a JSON object"):
        checkpoint_shape(tmp_path)


BASE = {"num_hidden_layers": 4, "num_attention_heads": 32, "hidden_size": 4096}


@pytest.mark.parametrize("extra,named", [
    ({"num_key_value_heads": 0}, "num_key_value_heads=0"), ({"num_key_value_heads": "8"}, "num_key_value_heads='8'"),
    ({"num_key_value_heads": 8.0}, "num_key_value_heads=8.0"), ({"num_key_value_heads": True}, "num_key_value_heads=True"),
    ({"num_key_value_heads": -8}, "num_key_value_heads=-8"), ({"num_key_value_heads": 5}, "multiple of the KV heads"),
    ({"head_dim": 0}, "head_dim=0"), ({"head_dim": True}, "head_dim=True"), ({"head_dim": "128"}, "head_dim='128'"),
    ({"head_dim": -128}, "head_dim=-128"), ({"hidden_size": 4095}, "hidden_size=4095 and num_attention_heads=32"),
    ({"hidden_size": "4096"}, "hidden_size='4096'"), ({"torch_dtype": "int7"}, "dtype 'int7'"),
    ({"torch_dtype": 5}, "dtype '5'"),
])
def test_a_malformed_shape_entry_is_refused_by_name(tmp_path, extra, named):
    """Entries a plan or an engine would size KV by: each wrong one named, none silently replaced (a zero KV
    head count read as 'absent', a zero head_dim as 128, a floored head_dim, an unknown dtype as bfloat16)."""
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **extra}))
    with pytest.raises(ValueError, match=re.escape(named)):
        checkpoint_shape(str(tmp_path))


def test_a_config_object_with_dtype_is_never_asked_for_torch_dtype():
    """transformers 5 warns on every read of `torch_dtype` (every random-model run printed it): a config that
    has `dtype` (None included) is read by it alone; a config.json naming only torch_dtype still counts."""

    class NoTorchDtype(LlamaConfig):
        @property
        def torch_dtype(self):
            raise AssertionError("torch_dtype read")

    for dtype, want in ((None, "bfloat16"), ("float32", "float32")):
        config = NoTorchDtype(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=128, dtype=dtype)
        assert model_shape(config).dtype == want
    assert model_shape({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                        "torch_dtype": "float32"}).dtype == "float32"


_QWEN2 = {"model_type": "qwen2", "hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2,
          "num_hidden_layers": 4, "intermediate_size": 4864, "vocab_size": 1000, "max_position_embeddings": 32768,
          "sliding_window": 4096}


@pytest.mark.parametrize("extra, window", [
    ({}, None),  # Qwen2's use_sliding_window defaults to false: vLLM and transformers run every layer whole
    ({"use_sliding_window": False}, None),
    ({"use_sliding_window": True, "max_window_layers": 4}, None),  # the first 4 layers full: none slides
    ({"use_sliding_window": True, "max_window_layers": 2}, 4096),
    ({"model_type": "mistral"}, 4096),  # Mistral attends its window whenever one is set
    ({"layer_types": ["full_attention"] * 4}, None),
    ({"use_sliding_window": True, "layer_types": ["full_attention", "sliding_attention"] * 2}, 4096),
])
def test_a_window_no_layer_uses_is_no_window_as_transformers_reads_the_config(tmp_path, extra, window):
    from transformers import AutoConfig

    cfg = {**_QWEN2, **extra}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert checkpoint_shape(str(tmp_path)).sliding_window == window == model_shape(cfg).sliding_window
    loaded = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    assert model_shape(loaded).sliding_window == window
