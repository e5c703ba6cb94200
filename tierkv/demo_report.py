"""What the demos print of `TieredLLM.stats()`: per-tier hit rates and bytes, the chain's moves,
the transfers.

Primitives: `print_tiers`, `pct`.
"""
from __future__ import annotations

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
