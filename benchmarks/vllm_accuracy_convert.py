"""A GGUF checkpoint (SmolLM2-135M-Instruct Q4_1: tierkv.model_loading's `smollm2-135m`) as a folder
vLLM loads: safetensors weights, config.json, the tokenizer with its chat template, the generation config.

Primitives: `convert`, `folder_config`, `weight_tensors`.

    model = convert("SmolLM2-135M-Instruct.Q4_1.gguf", "/tmp/smollm2")   # the GGUF-loaded model, for checks

The weights are the GGUF's, dequantized by transformers (`from_pretrained(dir, gguf_file=...)`) to
`dtype`. A tied embedding is written under BOTH names ("model.embed_tokens.weight" and
"lm_head.weight"): vLLM's Llama loader skips lm_head.weight for a tied model, and a folder holding only
lm_head.weight (what some savers keep of a tied pair) leaves vLLM's embedding unloaded: empty answers.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def convert(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "bfloat16"):
    """Write the folder to `out_dir` (created; files there of the same names replaced) and return the
    GGUF-loaded model (eval mode, CPU, `dtype`). ValueError: not a .gguf file, or a dtype not in DTYPES."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from safetensors.torch import save_file

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file() or gguf_path.suffix != ".gguf":
        raise ValueError(f"GGUF: got {str(gguf_path)!r}; expected an existing .gguf file")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: got {dtype!r}; allowed: {', '.join(DTYPES)}")
    source = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(**source, dtype=DTYPES[dtype]).eval()
    if model.dtype != DTYPES[dtype]:  # a transformers that spells it torch_dtype (4.x before 4.56); not
        # model.to(dtype), which would also round the float32 rotary inv_freq buffer and change the logits
        model = AutoModelForCausalLM.from_pretrained(**source, torch_dtype=DTYPES[dtype]).eval()
    if model.dtype != DTYPES[dtype]:
        raise RuntimeError(f"transformers loaded {gguf_path.name} as {model.dtype}, not the {dtype} asked for")
    tokenizer = AutoTokenizer.from_pretrained(**source)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weight_tensors(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(folder_config(model, dtype), indent=2, default=str) + "\n")
    tokenizer.save_pretrained(str(out))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(out))
    return model


def weight_tensors(model) -> dict[str, torch.Tensor]:
    """Every tensor of the model's state dict, each its own contiguous copy (safetensors refuses
    shared storage), with the tied embedding under both names."""
    state = model.state_dict()
    tensors = {name: t.detach().contiguous().clone() for name, t in state.items()}
    if getattr(model.config, "tie_word_embeddings", False):
        embedding = tensors.get(EMBED, tensors.get(LM_HEAD))
        if embedding is None:
            raise ValueError(f"tie_word_embeddings is set and the state dict has neither {EMBED} nor {LM_HEAD}")
        for name in (EMBED, LM_HEAD):
            if name not in tensors:
                tensors[name] = embedding.clone()
    return tensors


def folder_config(model, dtype: str) -> dict:
    """config.json: the model's config without the GGUF quantization_config, its dtype named (as
    transformers 5 and 4 each spell it), its architecture named, and rope_theta beside
    rope_parameters (a transformers 4 reader, or a vLLM taking only the flat key, finds it)."""
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    for key in ("_name_or_path", "_model_name_or_path"):
        config.pop(key, None)  # the GGUF's local path and its training name: not this folder's
    config["dtype"] = config["torch_dtype"] = dtype
    config["architectures"] = [type(model).__name__]
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
    return config
