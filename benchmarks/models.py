"""Random-weight models of real shapes, built in code on the device (no downloads)."""
from __future__ import annotations

import torch

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=131072)


def draw_qk_biases(model, std: float) -> None:
    """A Llama with attention_bias: q and k projection biases drawn N(0, std^2), v and o biases zero."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj.bias.normal_(0.0, std)
            attn.k_proj.bias.normal_(0.0, std)
            attn.v_proj.bias.zero_()
            attn.o_proj.bias.zero_()


def llama_8b_shaped(num_layers: int = 32, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                    qk_bias_std: float = 0.0):
    """Llama-3.1-8B layer shapes with `num_layers` layers, random weights (std 0.02), in `dtype` on `device`.
    qk_bias_std > 0: q and k projection biases drawn N(0, qk_bias_std^2) (`draw_qk_biases`), so each
    head's query keeps its direction from token to token and consecutive sparse selections overlap."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if qk_bias_std < 0:
        raise ValueError(f"qk_bias_std: got {qk_bias_std}; a standard deviation is at least 0")
    torch.manual_seed(seed)
    config = LlamaConfig(**LLAMA_8B, num_hidden_layers=num_layers, eos_token_id=None, bos_token_id=None,
                         attention_bias=qk_bias_std > 0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
            if qk_bias_std > 0:
                draw_qk_biases(model, qk_bias_std)
    finally:
        torch.set_default_dtype(previous)
    model.set_attn_implementation("sdpa")
    return model.eval()


def kv_bytes_per_token(model) -> int:
    cfg = model.config
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * next(model.parameters()).element_size()
