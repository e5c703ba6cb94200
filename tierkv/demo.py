"""The main job on an embedded default: a small Llama-architecture model built in code, a long
prompt through TieredLLM with a GPU budget far below its KV, CPU and disk tiers.

    python -m tierkv.demo [--config configs/default.yaml] [--prompt-tokens 4096] [--new-tokens 16]

Runs three requests — prompt A, prompt B, prompt A again — so the third reuses A's prefix from
whichever tier holds it, then prints the tokens, per-tier hit rates and bytes moved. No
download and no GPU needed; on a GPU it runs there (bf16).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from tierkv.config import load_config
from tierkv.configs import SHIPPED_DIR
from tierkv.units import format_bytes

DEFAULT_CONFIG = SHIPPED_DIR / "default.yaml"  # shipped inside the package


def tiny_llama(seed: int = 0, num_layers: int = 4):
    """A random-weight Llama-architecture model: GQA 8 heads / 2 KV heads, head_dim 64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=num_layers,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536,
                      rope_theta=500000.0, eos_token_id=None, bos_token_id=None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="tierkv YAML config")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print the full stats as JSON too")
    args = parser.parse_args(argv)

    from tierkv.llm import TieredLLM

    config = load_config(args.config)
    model = tiny_llama()
    llm = TieredLLM(model, config, show_progress=True)
    rt = llm.runtime
    kv_per_token = rt.layout.num_bytes // rt.layout.block_tokens * rt.num_layers
    print(f"model: {rt.num_layers} layers, KV {format_bytes(kv_per_token)}/token on {rt.device}; "
          f"prompt KV {format_bytes(kv_per_token * args.prompt_tokens)} vs GPU budget "
          f"{format_bytes(config.cache.gpu_budget_bytes)} (resident {format_bytes(rt.pool.resident_bytes)}"
          f" + staging {format_bytes(rt.pool.staging_bytes)})")
    gen = torch.Generator().manual_seed(1)
    prompt_a = torch.randint(0, 2048, (args.prompt_tokens,), generator=gen).tolist()
    prompt_b = torch.randint(0, 2048, (args.prompt_tokens,), generator=gen).tolist()
    with llm:
        for name, prompt in (("A", prompt_a), ("B", prompt_b), ("A again", prompt_a)):
            (out,) = llm.generate([prompt], max_new_tokens=args.new_tokens)
            s = out.stats
            print(f"request {name}: {s['prompt_tokens']} prompt tokens, {s['prefix_tokens']} reused "
                  f"{s['prefix_blocks_by_tier'] or ''}; prefill {s['prefill_s']:.2f}s, decode {s['decode_s']:.2f}s; "
                  f"GPU hit rate {_pct(s['gpu_hit_rate'])}, H2D {format_bytes(s['h2d_bytes'])}, "
                  f"D2H {format_bytes(s['d2h_bytes'])}, stalls {s['stalls']}")
            print(f"  tokens: {out.token_ids}")
        stats = llm.stats()
    print("tiers:")
    for tier in stats["tiers"]:
        print(f"  {tier['tier']:<6} hit rate {_pct(tier['hit_rate'])} ({tier['hits']}/{tier['lookups']}), "
              f"read {format_bytes(tier['bytes_read'])}, written {format_bytes(tier['bytes_written'])}, "
              f"evictions {tier['evictions']}")
    chain = stats["chain"]
    print(f"  chain: spilled {chain['spilled']}, promoted {chain['promoted']}, dropped {chain['dropped']}")
    print(f"transfers: H2D {format_bytes(stats['transfer']['h2d_bytes'])}, D2H {format_bytes(stats['transfer']['d2h_bytes'])}"
          f" ({stats['transfer']['backend']}), stalls {stats['scheduler']['stalls']}")
    if args.json:
        print(json.dumps(stats, indent=2, default=str))
    return 0


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


if __name__ == "__main__":
    sys.exit(main())
