"""What the weights digest in every block address costs: `weights_digest` against hashing every
weight byte and against one prefill forward, on one model, in one run.

    python benchmarks/bench_fingerprint.py [--shape smollm2-135m|llama-8b] [--layers N] [--out PATH]

smollm2-135m: SmolLM2-135M's shape (30 layers, hidden 576, vocab 49152, tied embeddings; random
weights, built in code), float32 on the CPU or bf16 on CUDA. llama-8b: Llama-3.1-8B layer shapes
(GPU). The digest is computed once per runtime, so its ratio to the baselines is what a user waits.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import write_results  # noqa: E402

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, rope_theta=100000.0, max_position_embeddings=8192,
                    tie_word_embeddings=True)


def build(shape: str, layers: int | None, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape == "llama-8b":
        from benchmarks.models import llama_8b_shaped

        return llama_8b_shaped(num_layers=layers or 32, device=device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    config = LlamaConfig(**SMOLLM2_135M, num_hidden_layers=layers or 30, eos_token_id=None, bos_token_id=None)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def full_hash(model) -> str:
    h = hashlib.blake2b(digest_size=16)
    for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        h.update(p.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("smollm2-135m", "llama-8b"), default="smollm2-135m")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-tokens", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/results/fingerprint.json")
    args = parser.parse_args()
    from tierkv.model_identity import weights_digest

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build(args.shape, args.layers, device)
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (1, args.prefill_tokens), device=device)
    weights_digest(model)  # first call: imports and allocator warm-up
    with torch.no_grad():
        model(ids)
    digest_s = best_of(lambda: weights_digest(model), args.repeats)
    full_s = best_of(lambda: full_hash(model), args.repeats)
    with torch.no_grad():
        forward_s = best_of(lambda: model(ids), args.repeats)
    results = {"shape": args.shape, "device": device, "weight_bytes": num_bytes,
               "num_tensors": len(list(model.parameters())) + len(list(model.buffers())),
               "digest_s": digest_s, "full_hash_s": full_s, f"prefill_{args.prefill_tokens}_s": forward_s,
               "digest_over_full_hash": digest_s / full_s, "digest_over_prefill": digest_s / forward_s}
    write_results(args.out, results)
    for key, value in results.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
