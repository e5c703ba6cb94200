"""Small random-weight models from real architecture configs, built in code (no downloads)."""
from __future__ import annotations

import copy

import torch


def build(arch: str, *, num_heads: int = 8, num_kv_heads: int = 2, head_dim: int = 16, num_layers: int = 2,
          vocab_size: int = 512, seed: int | None = None):
    """A (model, reference) pair with identical weights; the reference keeps stock attention."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=vocab_size, hidden_size=num_heads * head_dim, intermediate_size=2 * num_heads * head_dim,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  head_dim=head_dim, max_position_embeddings=8192, eos_token_id=None, bos_token_id=None)
    if arch == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    elif arch == "qwen2":  # q/k/v biases
        config, cls = Qwen2Config(**common, use_sliding_window=False), Qwen2ForCausalLM
    elif arch == "mistral":
        config, cls = MistralConfig(**common, sliding_window=None), MistralForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}")
    return pair(cls, config, seed)


def pair(cls, config, seed: int | None = None):
    """A (model, reference) pair of model class `cls` built from transformers `config`, identical weights
    (random, larger than the default init: sharper attention, real tests); the reference keeps stock attention."""
    if seed is not None:
        torch.manual_seed(seed)
    model = cls(config).eval()
    for param in model.parameters():
        param.data.normal_(0, 0.2)
    reference = cls(copy.deepcopy(config)).eval()
    reference.load_state_dict(model.state_dict())
    reference.set_attn_implementation("sdpa")
    return model, reference


def small_config(name: str, *, num_layers: int, num_kv_heads: int, head_dim: int, prefill_chunk_tokens: int):
    """A tierkv config for these small float32 models: 4-token blocks, 4 sink and 8 window tokens, 6 GPU
    slots per layer, a CPU tier of 4096 blocks, staging of 128 blocks."""
    from tierkv.config import load_config

    block_bytes = 2 * num_kv_heads * 4 * head_dim * 4
    return load_config({"model": {"name": name},
                        "cache": {"block_tokens": 4, "gpu_budget_bytes": num_layers * 6 * block_bytes, "sink_tokens": 4,
                                  "window_tokens": 8},
                        "tiers": [{"kind": "cpu", "capacity_bytes": 4096 * block_bytes}],
                        "scheduler": {"lookahead_layers": 1, "staging_bytes": 128 * block_bytes,
                                      "prefill_chunk_tokens": prefill_chunk_tokens}}, env={})


@torch.no_grad()
def reference_greedy(reference, ids: list[int], num_new: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and per-step last-position logits with transformers' DynamicCache."""
    from transformers import DynamicCache

    from tierkv.integrations.hf import forward_kwargs

    kwargs = forward_kwargs(reference, DynamicCache(config=reference.config))
    logits = reference(torch.tensor([ids]), **kwargs).logits[0, -1]
    tokens, all_logits = [], [logits]
    for _ in range(num_new):
        token = int(torch.argmax(logits))
        tokens.append(token)
        logits = reference(torch.tensor([[token]]), **kwargs).logits[0, -1]
        all_logits.append(logits)
    return tokens, all_logits
