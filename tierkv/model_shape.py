"""The KV shape of a transformers model, read from its config: one parser for a checkpoint's
config.json, a loaded model's config object, and `tierkv plan --model-config`.

Primitives: `ModelShape` (`dtype_bytes`, `kv_shape`), `model_shape`, `read_config_json`, `checkpoint_shape`,
`text_config`, `pins_shape`, `check_configured_shape`.

    config (or its text_config, for a multimodal model)     ModelShape
      num_hidden_layers, num_attention_heads             -> num_layers, num_heads (positive ints)
      num_key_value_heads (default: num_attention_heads) -> num_kv_heads
      head_dim (default: hidden_size // heads)           -> head_dim
      torch_dtype / dtype, max_position_embeddings,      -> dtype, max_position_embeddings,
      sliding_window (unless no layer uses it)           sliding_window (None when absent)
    (encoder-decoder families: decoder_layers, decoder_attention_heads, d_model: the decoder's KV)
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from tierkv.config.errors import ConfigError


KV_SHAPE_KEYS = ("num_layers", "num_kv_heads", "head_dim")


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str                              # as the config names it ("bfloat16", "float32", ...)
    max_position_embeddings: int | None
    sliding_window: int | None              # the model's own window, None when absent or turned off
    name: str | None = None                 # `_name_or_path`, when the config has one

    def kv_shape(self) -> dict[str, int]:
        """num_layers, num_kv_heads, head_dim (KV_SHAPE_KEYS): what a tierkv config's `model` section may pin."""
        return {key: getattr(self, key) for key in KV_SHAPE_KEYS}

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the checkpoint's dtype: 4 for float32, else 2."""
        return 4 if self.dtype in ("float32", "torch.float32") else 2


def _get(cfg: Any, key: str) -> Any:
    return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)


_DTYPES = ("bfloat16", "float16", "float32")


def _dtype_of(cfg: Any) -> Any:
    """A config's dtype: `dtype`, else (older config.json files, or config objects that predate `dtype`)
    `torch_dtype`. A config object with a `dtype` attribute is not asked for `torch_dtype`: transformers 5
    warns on every read of it."""
    if isinstance(cfg, dict):
        return cfg.get("dtype") or cfg.get("torch_dtype")
    if hasattr(type(cfg), "dtype") or "dtype" in getattr(cfg, "__dict__", {}):
        return getattr(cfg, "dtype", None)
    return getattr(cfg, "torch_dtype", None)


def _positive(cfg: Any, key: str, source: str) -> int | None:
    """cfg's `key` when given (None when absent or null); ValueError naming it unless a positive integer."""
    value = _get(cfg, key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"model: {source} has {key}={value!r}; a positive integer is needed")
    return value


def _decoder_view(cfg: Any) -> Any:
    """A config of the encoder-decoder families (Bart, Marian, Pegasus, Whisper: `decoder_layers` and
    `decoder_attention_heads`, whose num_hidden_layers and num_attention_heads name the encoder's) as a dict
    of its decoder's counts, which hold the KV of a ForCausalLM; any other config as it is."""
    layers, heads = _get(cfg, "decoder_layers"), _get(cfg, "decoder_attention_heads")
    if layers is None or heads is None:
        return cfg
    view = {key: _get(cfg, key) for key in ("hidden_size", "head_dim", "sliding_window", "use_sliding_window")}
    positions = _get(cfg, "max_target_positions")  # Whisper's decoder: its own table of positions
    return {**view, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": _get(cfg, "decoder_key_value_heads"), "dtype": _dtype_of(cfg),
            "hidden_size": view["hidden_size"] or _get(cfg, "d_model"),
            "max_position_embeddings": positions if positions is not None else _get(cfg, "max_position_embeddings")}


def _sliding_window(cfg: Any) -> int | None:
    """The window some layer of the model attends, None when no layer slides: `sliding_window` unless
    `use_sliding_window` is false, or `layer_types` names no sliding layer. A config.json without those flags
    is read as transformers reads it (Qwen2's `use_sliding_window` defaults to false, its `max_window_layers`
    keeps the first layers full): a window it names but no layer uses is no window, as vLLM runs it too."""
    window = _get(cfg, "sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1 or _get(cfg, "use_sliding_window") is False:
        return None
    if isinstance(cfg, dict) and "layer_types" not in cfg:
        cfg = _as_transformers_config(cfg) or cfg
    layer_types = _get(cfg, "layer_types")
    if isinstance(layer_types, (list, tuple)) and layer_types and not any("sliding" in str(t) for t in layer_types):
        return None
    return None if _get(cfg, "use_sliding_window") is False else window


def _as_transformers_config(cfg: dict) -> Any:
    """transformers' config object of a config.json's model_type (its defaults and derived layer_types), or None
    when transformers is missing or does not know the type or the values."""
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str):
        return None
    try:
        from transformers import AutoConfig

        return AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "model_type"})
    except Exception:  # any failure leaves the dict as it is read without transformers
        return None


def text_config(cfg: Any) -> Any:
    """The language model's part of a config (a multimodal one's text_config), as a dict or a config object."""
    if isinstance(cfg, dict):
        inner = cfg.get("text_config")
        if inner is not None and not isinstance(inner, dict):
            raise ValueError(f"model: the config has text_config={inner!r:.60}; an object (the language model's config)")
        return inner or cfg
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def model_shape(cfg: Any, source: str = "model config") -> ModelShape:
    """The shape of a config given as a dict (config.json) or a transformers config object; ValueError
    naming `source`, the key and its value when a needed entry is missing or not a positive integer."""
    text = _decoder_view(text_config(cfg))
    for key in ("num_hidden_layers", "num_attention_heads"):
        if _positive(text, key, source) is None:
            raise ValueError(f"model: {source} has {key}=None; a positive integer is needed")
    heads = _get(text, "num_attention_heads")
    kv_heads = _positive(text, "num_key_value_heads", source)
    if kv_heads is not None and heads % kv_heads:
        raise ValueError(f"model: {source} has num_attention_heads={heads} and num_key_value_heads={kv_heads}; "
                         "the attention heads must be a multiple of the KV heads")
    head_dim = _positive(text, "head_dim", source)
    if head_dim is None:
        hidden = _positive(text, "hidden_size", source)
        if hidden is None:
            raise ValueError(f"model: {source} gives neither head_dim nor hidden_size")
        if hidden % heads:
            raise ValueError(f"model: {source} has hidden_size={hidden} and num_attention_heads={heads} and no "
                             "head_dim; hidden_size must be a multiple of the heads")
        head_dim = hidden // heads
    window = _sliding_window(text)
    dtype = _dtype_of(text) or _dtype_of(cfg) or "bfloat16"
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"model: {source} has dtype {dtype!r}; one of {', '.join(_DTYPES)} is needed")
    name = _get(cfg, "_name_or_path")
    return ModelShape(num_layers=_get(text, "num_hidden_layers"), num_heads=heads,
                      num_kv_heads=kv_heads or heads, head_dim=head_dim, dtype=dtype,
                      max_position_embeddings=_positive(text, "max_position_embeddings", source),
                      sliding_window=window if isinstance(window, int) and window > 0 else None,
                      name=name if isinstance(name, str) and name else None)


def read_config_json(path: str | os.PathLike) -> dict:
    """A config.json as a dict; ValueError naming the path when it cannot be read as a JSON object."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"model: {os.fspath(path)} cannot be read as JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"model: {os.fspath(path)} holds {type(raw).__name__}, not a JSON object")
    return raw


def checkpoint_shape(model_dir: str | os.PathLike) -> ModelShape:
    """The shape of a checkpoint directory, from its config.json."""
    path = os.path.join(os.fspath(model_dir), "config.json")
    return model_shape(read_config_json(path), path)


def pins_shape(model_config: Any) -> bool:
    """Whether a tierkv config's `model` section sets any of KV_SHAPE_KEYS (else there is nothing to check)."""
    return any(getattr(model_config, key) is not None for key in KV_SHAPE_KEYS)


def check_configured_shape(model_config: Any, kv: Mapping[str, int], source: str | None = None) -> None:
    """ConfigError naming the first of `model_config`'s (a tierkv config's `model` section) num_layers /
    num_kv_heads / head_dim that is set and is not the model's (`kv`, `ModelShape.kv_shape`); `source`: where the
    model's shape was read, named in the error."""
    for key, value in kv.items():
        configured = getattr(model_config, key)
        if configured is not None and configured != value:
            raise ConfigError(f"model.{key}", configured, f"the model has {value}" + (f" ({source})" if source else ""))
