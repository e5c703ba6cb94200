"""What the demos print of `TieredLLM.stats()`: per-tier hit rates and bytes, the chain's moves,
the transfers; and progress bars for a run that has none of its own.

Primitives: `print_tiers`, `pct`, `forward_progress`.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

from tierkv.units import format_bytes


def print_tiers(stats: dict) -> None:
    """Per-tier hit rates and bytes, the chain's moves and the transfers, from `TieredLLM.stats()`."""
    print("tiers:")
    for tier in stats["tiers"]:
        print(f"  {tier['tier']:<6} hit rate {pct(tier['hit_rate'])} ({tier['hits']}/{tier['lookups']}), "
              f"read {format_bytes(tier['bytes_read'])}, written {format_bytes(tier['bytes_written'])}, "
              f"evictions {tier['evictions']}")
    chain = stats["chain"]
    print(f"  chain: spilled {chain['spilled']}, promoted {chain['promoted']}, dropped {chain['dropped']}")
    print(f"transfers: H2D {format_bytes(stats['transfer']['h2d_bytes'])}, D2H {format_bytes(stats['transfer']['d2h_bytes'])}"
          f" ({stats['transfer']['backend']}), stalls {stats['scheduler']['stalls']}")


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


class ForwardProgress:
    """A prefill bar, then a decode bar, on stderr in tokens (tok/s) as TieredLLM draws its own, fed by each
    forward of the model (`count`, a forward hook). The prefill bar counts the prompt's tokens as each chunk
    is run; the decode bar counts one answer token per forward after it, plus the first, which the prompt's
    last logits give."""

    def __init__(self, num_prompt_tokens: int, max_new_tokens: int, desc: str):
        from tqdm.auto import tqdm

        self._tqdm, self._desc, self._max_new_tokens = tqdm, desc, max_new_tokens
        self.prefill = tqdm(total=num_prompt_tokens, unit="tok", desc=f"{desc} prefill", file=sys.stderr)
        self.decode = None

    def count(self, module, args, kwargs, output) -> None:
        if self.decode is not None:
            self.decode.update(1)
            return
        fed = kwargs.get("input_ids", args[0] if args else None)  # [batch, tokens]
        self.prefill.update(fed.shape[-1])
        if self.prefill.n >= self.prefill.total:
            self.prefill.close()
            self.decode = self._tqdm(total=self._max_new_tokens, unit="tok", desc=f"{self._desc} decode",
                                     file=sys.stderr)
            self.decode.update(1)

    def close(self, completed: bool) -> None:
        """Close the bars; `completed`: the run ended by itself, so the decode bar ends full at the tokens made
        (an end-of-sequence token may come before max_new_tokens: a bar stopped at 70% reads as an abort)."""
        self.prefill.close()
        if self.decode is not None:
            if completed:
                self.decode.total = self.decode.n
                self.decode.refresh()
            self.decode.close()


@contextmanager
def forward_progress(model, num_prompt_tokens: int, max_new_tokens: int, desc: str):
    """`ForwardProgress` bars over the forwards of `model` (a torch module) inside the block, for a run with no
    progress of its own (`tierkv.longdoc.dense_greedy`)."""
    progress = ForwardProgress(num_prompt_tokens, max_new_tokens, desc)
    handle = model.register_forward_hook(progress.count, with_kwargs=True)
    completed = False
    try:
        yield progress
        completed = True
    finally:
        handle.remove()
        progress.close(completed)
