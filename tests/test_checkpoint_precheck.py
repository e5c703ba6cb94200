"""A checkpoint directory whose shape is not the config's model keys is refused before its weights load (an 8B
checkpoint takes minutes to load), naming the key, the value and the checkpoint's config.json."""
from __future__ import annotations

import json

import pytest

from tierkv import TieredLLM
from tierkv.config import ConfigError


def _checkpoint(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "intermediate_size": 128,
        "vocab_size": 256, "max_position_embeddings": 512}))
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the loader is replaced below
    return str(tmp_path)


class WeightsLoaded(Exception):
    pass


@pytest.fixture
def loads(monkeypatch):
    import transformers

    calls = []

    def from_pretrained(*args, **kwargs):
        calls.append(args)
        raise WeightsLoaded

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    return calls


@pytest.mark.parametrize("key, value, actual", [("num_layers", 32, 2), ("num_kv_heads", 8, 2), ("head_dim", 128, 16)])
def test_a_shape_the_checkpoint_does_not_have_is_refused_before_the_weights_load(tmp_path, loads, key, value, actual):
    path = _checkpoint(tmp_path)
    with pytest.raises(ConfigError, match=rf"model\.{key}'?: got {value}; the model has {actual} \(.*config\.json\)"):
        TieredLLM(path, {"model": {key: value}})
    assert loads == []


def test_a_matching_or_unset_shape_goes_on_to_load(tmp_path, loads):
    path = _checkpoint(tmp_path)
    for model in ({"num_layers": 2, "num_kv_heads": 2, "head_dim": 16}, {}):
        with pytest.raises(WeightsLoaded):
            TieredLLM(path, {"model": model})
    assert len(loads) == 2
