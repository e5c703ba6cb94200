"""vLLM with the tierkv connector against plain vLLM, on the GPU machine (vLLM bundle).

    python benchmarks/vllm_check.py model DIR       # build a random-weight Llama-shaped checkpoint
    python benchmarks/vllm_check.py plain DIR OUT    # plain vLLM, full pool, prefix caching off
    python benchmarks/vllm_check.py tierkv DIR OUT   # TieredLLM(backend="vllm", hot_window=False): connector only
    python benchmarks/vllm_check.py hotwindow DIR OUT  # TieredLLM(backend="vllm"): vLLM's pool holds a 2048-token window
    python benchmarks/vllm_check.py compare OUT [MODE] # MODE (tierkv | hotwindow) against plain: greedy tokens
                                                       # equal? near-ties shown by logprobs

Each engine runs in its own process (vLLM's in-process engine is not torn down between runs).
Workload, the same for both: a long prompt P; the same prompt again (tierkv: its blocks come
back from the CPU and disk tiers; vLLM's own prefix cache is off in both runs so that the
repeat measures the tiers); P's first 3/4 with a new tail; a batch of three uneven prompts.
The tierkv config keeps the CPU tier smaller than P's KV so part of it is served from disk.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT_TOKENS = 12288
NEW_TOKENS = 16
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=32768)


def build_model(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, bos_token_id=1, eos_token_id=2, rope_theta=500000.0, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    for p in model.parameters():  # sharper logits than the default std 0.02: fewer near-ties
        p.data.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(path)
    config.save_pretrained(path)
    print(f"model {path}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")


def workload() -> list[tuple[str, list[list[int]]]]:
    import random

    rng = random.Random(1)
    long = [rng.randrange(3, 32000) for _ in range(PROMPT_TOKENS)]
    tail = [rng.randrange(3, 32000) for _ in range(700)]
    batch = [[rng.randrange(3, 32000) for _ in range(n)] for n in (1500, 6000, 3100)]
    return [("first", [long]), ("repeat", [long]), ("shared_prefix", [long[: 3 * PROMPT_TOKENS // 4] + tail]),
            ("uneven_batch", batch)]


HOT_WINDOW_TOKENS = 2048


def kv_per_token() -> int:
    return 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * SHAPE["head_dim"] * 2


def hot_window_config(out: str) -> dict:
    """Window 2048 tokens, prefill chunks of 2048: every prompt of the workload is longer than the
    window, so its attention reads far blocks from the CPU tier at every step after the first."""
    return {
        "cache": {"block_tokens": 16, "window_tokens": HOT_WINDOW_TOKENS, "gpu_budget_bytes": 512 << 20},
        "tiers": [{"kind": "cpu", "capacity_bytes": kv_per_token() * 200_000},
                  {"kind": "disk", "path": os.path.join(out, "disk"), "capacity_bytes": kv_per_token() * 400_000, "trusted": True}],
        "scheduler": {"lookahead_layers": 2, "staging_bytes": 128 << 20, "prefill_chunk_tokens": 2048},
    }


def tierkv_config(out: str) -> dict:
    kv_per_token = globals()["kv_per_token"]()
    return {
        "cache": {"block_tokens": 16},
        "tiers": [{"kind": "cpu", "capacity_bytes": kv_per_token * PROMPT_TOKENS // 2},
                  {"kind": "disk", "path": os.path.join(out, "disk"), "capacity_bytes": kv_per_token * 200_000, "trusted": True}],
        "scheduler": {"lookahead_layers": 2, "staging_bytes": 256 << 20},
    }


def run(mode: str, model_dir: str, out: str) -> None:
    engine_args = dict(max_model_len=32768, gpu_memory_utilization=0.35, enable_prefix_caching=False,
                       attention_config={"backend": "FLASH_ATTN"}, skip_tokenizer_init=True)
    if mode == "plain":
        from vllm import LLM, SamplingParams

        llm = LLM(model=model_dir, enforce_eager=True, **engine_args)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)

        def generate(prompts):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [(list(o.outputs[0].token_ids),
                     [sorted((x.logprob for x in s.values()), reverse=True) for s in o.outputs[0].logprobs]) for o in outs]
        stats = lambda: {}  # noqa: E731
    else:
        from tierkv import TieredLLM
        from tierkv.sampling import SamplingParams

        if mode == "hotwindow":
            llm = TieredLLM(model_dir, hot_window_config(out), backend="vllm", max_model_len=32768,
                            skip_tokenizer_init=True)
        else:
            llm = TieredLLM(model_dir, tierkv_config(out), backend="vllm", hot_window=False, **engine_args)
        params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)

        def generate(prompts):
            outs = llm.generate(prompts, params)
            return [(o.token_ids, o.stats["top2_logprobs"]) for o in outs]
        stats = llm.stats
    generate([[5, 6, 7, 8] * 64])  # warm-up
    engine = llm.engine if mode != "plain" else llm
    cache = engine.llm_engine.vllm_config.cache_config
    results = {"kv_reserved_bytes": cache.num_gpu_blocks * cache.block_size * kv_per_token()}
    print(f"{mode}: vLLM KV pool {results['kv_reserved_bytes'] / 2**20:.0f} MiB "
          f"({cache.num_gpu_blocks} blocks of {cache.block_size} tokens)")
    for name, prompts in workload():
        start = time.perf_counter()
        got = generate(prompts)
        results[name] = {"wall_s": time.perf_counter() - start, "tokens": [t for t, _ in got],
                         "top2": [lp for _, lp in got], "stats_after": stats()}
        print(f"{mode} {name}: {results[name]['wall_s']:.2f} s, tokens {[t[:6] for t, _ in got]}")
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"vllm-{mode}.json").write_text(json.dumps(results, indent=1, default=str))


def compare(out: str, mode: str = "tierkv") -> int:
    plain = json.loads((Path(out) / "vllm-plain.json").read_text())
    tiered = json.loads((Path(out) / f"vllm-{mode}.json").read_text())
    ok = True
    rows = []
    print(f"vLLM KV pool: plain {plain['kv_reserved_bytes'] / 2**20:.0f} MiB, {mode} {tiered['kv_reserved_bytes'] / 2**20:.0f} MiB")
    for name in [n for n in plain if n != "kv_reserved_bytes"]:
        for i, (a, b) in enumerate(zip(plain[name]["tokens"], tiered[name]["tokens"])):
            step = next((s for s, (x, y) in enumerate(zip(a, b)) if x != y), None)
            margin = None
            if step is not None:
                lp = plain[name]["top2"][i][step]
                margin = lp[0] - lp[1] if len(lp) > 1 else None
                ok &= margin is not None and margin < 0.05
            worst = max(abs(x - y) for p_lp, t_lp in zip(plain[name]["top2"][i], tiered[name]["top2"][i])
                        for x, y in zip(p_lp, t_lp))  # same-token steps: top-2 logprobs plain vs tierkv
            rows.append((name, i, len(a), step, margin, worst, plain[name]["wall_s"], tiered[name]["wall_s"]))
    counts = tiered["uneven_batch"]["stats_after"].get("counts", {})
    if mode == "hotwindow":
        far = tiered["uneven_batch"]["stats_after"].get("hot_window", {})
    print(f"{'case':<14} {'req':>3} {'tokens':>6} {'first diff':>10} {'plain top2 margin':>17} "
          f"{'max |logprob diff|':>18} {'plain s':>8} {'tierkv s':>8}")
    for name, i, n, step, margin, worst, tp, tt in rows:
        print(f"{name:<14} {i:>3} {n:>6} {str(step):>10} {str(margin and round(margin, 4)):>17} {worst:18.4f} "
              f"{tp:8.2f} {tt:8.2f}")
    print("tierkv connector counts:", counts)
    if mode == "hotwindow":
        print("hot window:", far)
        ok &= far.get("far_blocks_read", 0) > 0 and tiered["kv_reserved_bytes"] < plain["kv_reserved_bytes"]
        print("VLLM CHECK", "OK" if ok else "FAILED")
        return 0 if ok else 1
    loaded = tiered["repeat"]["stats_after"]["counts"]["blocks_loaded"] - tiered["first"]["stats_after"]["counts"]["blocks_loaded"]
    print(f"repeat: {loaded} blocks loaded from the tiers; tiers: "
          f"{[(t['name'] if 'name' in t else i, t.get('hits')) for i, t in enumerate(tiered['repeat']['stats_after'].get('tiers', []))]}")
    ok &= loaded > 0
    print("VLLM CHECK", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "model":
        build_model(sys.argv[2])
    elif mode == "compare":
        sys.exit(compare(sys.argv[2], *sys.argv[3:4]))
    else:
        run(mode, sys.argv[2], sys.argv[3])
