"""Selection recall for bench_accuracy: how much of the true attention mass over far blocks the
sparse selection holds, per layer and decode step.

Primitives: `FarLayout` (`of_config`, `far_blocks`), `capture_decode`, `DecodeCapture`, `cache_kwargs`,
`step_recall`, `case_recall`, `summarize_recall`.

What is computed (tierkv's sparse path does not run here; its selection is recomputed):

 1. transformers' own attention (SDPA) over a DynamicCache runs the prompt (prefill in chunks) and
    greedy decode. A forward pre-hook on every layer's attention module takes each decode step's
    hidden state and rotary (cos, sin) and rebuilds the query after rotary, q [num_heads, head_dim];
    the keys after rotary are the cache's at the end. The queries are those of the dense trajectory,
    not of tierkv's sparse run (whose earlier layers attend fewer blocks).
 2. The block layout of tierkv's sparse decode for the step at position t0 (t0 tokens held before):

        blocks 0 .. P-1 (front: sinks + resident far cache) | P .. w-1 (far candidates) | w .. (window)

    P and the window come from the config's GPU budget as tierkv's `plan_residency` splits it, the
    candidates as `scheduler.plan.step_blocks` takes them (`FarLayout`).
 3. The selection: `tierkv.sparse.select_far_blocks` on `BlockSummaries` of those keys (the Quest
    score of the run's bound weight, max over query heads, one selection per layer for all heads),
    k = token_budget // block_tokens.
    Every predictor attends this selection (predictors change what is copied ahead, not what is read).
 4. The truth: softmax(q k^T * scale) over positions 0..t0 per query head h. With F_h the mass on far
    blocks and S_h the mass on selected ones: recall = mean_h S_h / F_h; oracle recall = the same for
    the k far blocks that maximize it (top-k of mean_h mass_b,h / F_h); far mass = mean_h F_h (the
    share of all attention the far blocks hold); dropped mass = mean_h (F_h - S_h), the share of
    attention sparse decode leaves out. Needle: whether the selection holds every far block that holds
    the answer's tokens (None when none of them is far).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

FIELDS = ("recall", "oracle_recall", "far_mass", "dropped_mass", "needle_selected")


@dataclass(frozen=True)
class FarLayout:
    """tierkv's per-layer block split for one GPU budget (the same for every layer)."""

    block_tokens: int
    num_front_blocks: int   # P: sinks + resident far cache, from the start of the sequence
    num_window_blocks: int  # the most recent blocks, the one being filled included

    @classmethod
    def of_config(cls, config, num_layers: int, num_kv_heads: int, head_dim: int, element_bytes: int) -> "FarLayout":
        """As tierkv.storage.gpu.plan_residency splits `config.cache.gpu_budget_bytes`; ValueError, as
        tierkv refuses it, where the budget does not hold the sinks and the window."""
        T = config.cache.block_tokens
        block_bytes = 2 * num_kv_heads * T * head_dim * element_bytes
        slots = config.cache.gpu_budget_bytes // (block_bytes * num_layers)
        window = -(-config.cache.window_tokens // T) + 1
        if slots < -(-config.cache.sink_tokens // T) + window:
            raise ValueError(f"cache.gpu_budget_bytes {config.cache.gpu_budget_bytes} holds {slots} blocks per layer, "
                             f"fewer than the sinks and the window ({config.cache.sink_tokens} + "
                             f"{config.cache.window_tokens} tokens) need")
        return cls(T, slots - window, window)

    def far_blocks(self, t0: int) -> range:
        """The far candidates of the decode step of the token at position t0 (step_blocks with n = 1)."""
        first_block = t0 // self.block_tokens
        window_start = max(self.num_front_blocks, t0 // self.block_tokens + 1 - self.num_window_blocks)
        return range(self.num_front_blocks, max(self.num_front_blocks, min(first_block, window_start)))


@dataclass
class DecodeCapture:
    """Greedy tokens of the dense run; per decode step and layer the query after rotary
    (queries[step][layer]: float32 [num_heads, head_dim], CPU) and its position; the final keys after
    rotary per layer (float32 [num_kv_heads, seq, head_dim], CPU)."""

    tokens: list[int]
    positions: list[int] = field(default_factory=list)
    queries: list[list[torch.Tensor]] = field(default_factory=list)
    keys: list[torch.Tensor] = field(default_factory=list)
    scale: float = 1.0


def cache_kwargs(model, cache) -> dict:
    """The keyword that passes a cache to `model(...)`: `cache` in newer transformers, else `past_key_values`."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def _query_hook(store: dict, layer: int):
    def hook(module, args, kwargs):
        if not store["on"]:
            return
        hidden = kwargs.get("hidden_states", args[0] if args else None)  # [1, 1, hidden]
        cos, sin = kwargs["position_embeddings"]
        q = module.q_proj(hidden).view(1, 1, -1, module.head_dim).transpose(1, 2)  # [1, H, 1, D]
        rotary = sys.modules[type(module).__module__].apply_rotary_pos_emb
        q, _ = rotary(q, q, cos, sin)
        store["step"][layer] = q[0, :, 0].float().cpu()
        store["scale"] = module.scaling
    return hook


@torch.no_grad()
def capture_decode(model, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int],
                   chunk_tokens: int, forced: list[int] | None = None) -> DecodeCapture:
    """The dense greedy run (SDPA, DynamicCache; the same tokens as tierkv.longdoc.dense_greedy) with
    each decode step's queries captured. The first token comes from the prefill (no decode step).
    With `forced`, those tokens are fed instead (teacher forcing: len(forced) - 1 decode steps)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    layers = model.model.layers
    store = {"on": False, "step": [None] * len(layers), "scale": 1.0}
    hooks = [layer.self_attn.register_forward_pre_hook(_query_hook(store, i), with_kwargs=True)
             for i, layer in enumerate(layers)]
    try:
        cache = DynamicCache(config=model.config)
        kwargs = cache_kwargs(model, cache)
        for pos in range(0, len(prompt_ids), chunk_tokens):
            piece = torch.tensor([prompt_ids[pos : pos + chunk_tokens]], device=device)
            logits = model(input_ids=piece, logits_to_keep=1, **kwargs).logits[0, -1]
        out = DecodeCapture(tokens=[])
        store["on"] = True
        while True:
            token = forced[len(out.tokens)] if forced is not None else int(torch.argmax(logits))
            out.tokens.append(token)
            if token in stop_ids or len(out.tokens) >= max_new_tokens:
                break
            logits = model(input_ids=torch.tensor([[token]], device=device), **kwargs).logits[0, -1]
            out.positions.append(len(prompt_ids) + len(out.tokens) - 1)
            out.queries.append(list(store["step"]))
        out.keys = [cache.layers[i].keys[0].float().cpu() for i in range(len(layers))]
        out.scale = store["scale"]
        return out
    finally:
        for h in hooks:
            h.remove()
        model.set_attn_implementation(previous)


def block_summaries(keys: list[torch.Tensor], block_tokens: int, bound_weight: float = 1.0):
    """tierkv.sparse.BlockSummaries (CPU, float32, scoring with `bound_weight`) of every full block of
    keys[layer] [H_kv, seq, D]."""
    from tierkv.sparse import BlockSummaries

    num_kv_heads, seq, head_dim = keys[0].shape
    n = seq // block_tokens
    summaries = BlockSummaries(len(keys), num_kv_heads, head_dim, torch.float32, torch.device("cpu"),
                               bound_weight=bound_weight)
    for layer, k in enumerate(keys):
        blocks = k[:, : n * block_tokens].view(num_kv_heads, n, block_tokens, head_dim).transpose(0, 1)
        summaries.put(layer, 0, torch.cat([blocks.amax(dim=2), blocks.amin(dim=2)], dim=-1))
    return summaries


def step_recall(q: torch.Tensor, keys: torch.Tensor, scale: float, t0: int, far: range, selected: list[int],
                block_tokens: int, needle_blocks: set[int]) -> dict:
    """One layer, one decode step. q float32 [H, D]; keys float32 [H_kv, >= t0 + 1, D] (CPU)."""
    num_heads, num_kv = q.shape[0], keys.shape[0]
    k = keys[:, : t0 + 1].repeat_interleave(num_heads // num_kv, dim=0)             # [H, t0+1, D]
    probs = torch.softmax(torch.einsum("hd,htd->ht", q, k) * scale, dim=-1)        # [H, t0+1]
    T = block_tokens
    per_block = probs[:, far.start * T : far.stop * T].reshape(num_heads, len(far), T).sum(-1)  # [H, nf]
    far_mass = per_block.sum(-1)                                                   # [H]
    picked = torch.tensor([b - far.start for b in selected], dtype=torch.int64)
    held = per_block.index_select(1, picked).sum(-1)
    share = per_block / far_mass.clamp_min(1e-30)[:, None]
    best = share.mean(0).topk(len(selected)).indices
    far_needle = needle_blocks & set(far)
    return {"recall": float((held / far_mass.clamp_min(1e-30)).mean()),
            "oracle_recall": float(share.index_select(1, best).sum(-1).mean()),
            "far_mass": float(far_mass.mean()), "dropped_mass": float((far_mass - held).mean()),
            "needle_selected": (far_needle <= set(selected)) if far_needle else None}


def case_recall(capture: DecodeCapture, layout: FarLayout, token_budgets: list[int],
                needle_positions: list[int], bound_weight: float = 1.0) -> dict[int, dict[str, list]]:
    """{token budget: {field: per-layer mean over decode steps}} for one case (None where no step
    had far blocks, or, for the needle, where no step had the needle far)."""
    from tierkv.sparse import select_far_blocks

    summaries = block_summaries(capture.keys, layout.block_tokens, bound_weight)
    needle_blocks = {p // layout.block_tokens for p in needle_positions}
    num_layers = len(capture.keys)
    out = {}
    for budget in token_budgets:
        k = budget // layout.block_tokens
        sums = {f: [[] for _ in range(num_layers)] for f in FIELDS}
        for t0, queries in zip(capture.positions, capture.queries):
            far = layout.far_blocks(t0)
            if len(far) <= k:  # the budget covers every far block: sparse is exact here
                continue
            for layer, q in enumerate(queries):
                selected = select_far_blocks(summaries, layer, q, far, k)
                row = step_recall(q, capture.keys[layer], capture.scale, t0, far, selected, layout.block_tokens,
                                  needle_blocks)
                for f in FIELDS:
                    if row[f] is not None:
                        sums[f][layer].append(float(row[f]))
        out[budget] = {f: [sum(v) / len(v) if v else None for v in sums[f]] for f in FIELDS}
    return out


def summarize_recall(rows: list[dict]) -> list[dict]:
    """Per (task, context, token budget): each field's per-layer mean over cases, and the layers whose
    recall is lowest. rows: {"task", "context_tokens", "token_budget", and FIELDS as per-layer lists}."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["context_tokens"], row["token_budget"]), []).append(row)
    out = []
    for (task, ctx, budget), members in sorted(groups.items()):
        line = {"task": task, "context_tokens": ctx, "token_budget": budget, "cases": len(members)}
        for f in FIELDS:
            per_layer = list(zip(*[m[f] for m in members]))
            line[f] = [_mean([v for v in values if v is not None]) for values in per_layer]
        recalls = [(r, i) for i, r in enumerate(line["recall"]) if r is not None]
        line["mean_recall"] = _mean([r for r, _ in recalls])
        line["lowest_recall_layers"] = [i for _, i in sorted(recalls)[:5]]
        out.append(line)
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def needle_positions(prompt_ids: list[int], answer_ids: list[int]) -> list[int]:
    """Positions of every occurrence of the answer's token ids in the prompt (empty when absent)."""
    n = len(answer_ids)
    hits = [i for i in range(len(prompt_ids) - n + 1) if n and prompt_ids[i : i + n] == answer_ids]
    return [i + j for i in hits for j in range(n)]
