"""Random-weight models of real shapes, built in code on the device (no downloads)."""
from __future__ import annotations

import torch

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=131072)


def llama_8b_shaped(num_layers: int = 32, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """Llama-3.1-8B layer shapes with `num_layers` layers, random weights (std 0.02), in `dtype` on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**LLAMA_8B, num_hidden_layers=num_layers, eos_token_id=None, bos_token_id=None)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.set_attn_implementation("sdpa")
    return model.eval()


def kv_bytes_per_token(model) -> int:
    cfg = model.config
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * next(model.parameters()).element_size()
