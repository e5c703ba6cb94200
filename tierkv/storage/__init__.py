"""Storage tiers below the GPU and the chain that orders them.

Primitives: `StorageTier`, `PutResult`, `TierError`, `CpuTier`, `QuantizedTier`, `SealedTier`, `TierChain`,
`build_tiers`.
Disk and Redis tiers are imported on first use, so `import tierkv` never imports redis.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tierkv.blocks import BlockLayout, dtype_from_name, dtype_name
from tierkv.config import ConfigError, StorageConfig
from tierkv.config.fields import expand_path
from tierkv.metrics.snapshot import distinct_tier_names
from tierkv.quant import QUANT_FORMATS, packed_layout
from tierkv.storage.base import PutResult, StorageTier, TierError
from tierkv.storage.chain import TierChain
from tierkv.storage.cpu import CpuTier
from tierkv.storage.auth import sealer_for_tier
from tierkv.storage.quantized import QuantizedTier
from tierkv.storage.sealed import SealedTier

if TYPE_CHECKING:
    from tierkv.config import StorageConfig, TierConfig

__all__ = ["CpuTier", "PutResult", "QuantizedTier", "SealedTier", "StorageTier", "TierChain", "TierError", "build_tier", "build_tiers"]


def _quant_format(index: int, tier_config: "TierConfig", layout: BlockLayout) -> str | None:
    """The tier's quantized format, or None for blocks stored in the KV dtype (bit-exact)."""
    storage = tier_config.storage_dtype
    if storage in QUANT_FORMATS:
        if layout.head_dim < 4:
            raise ConfigError(f"tiers[{index}].storage_dtype", storage, "quantized storage needs head_dim >= 4")
        return storage
    if storage != "auto" and dtype_from_name(storage) != layout.dtype:
        raise ConfigError(
            f"tiers[{index}].storage_dtype", storage,
            f"must be 'auto', the KV dtype '{dtype_name(layout.dtype)}', or int8 / float8_e4m3fn",
        )
    return None


def build_tier(index: int, tier_config: "TierConfig", layout: BlockLayout, *, pin_memory: bool | None = None,
               storage: "StorageConfig | None" = None, name: str | None = None) -> StorageTier:
    """One tier from its config section, named `name` (default: its kind).

    Disk and Redis tiers are sealed (`SealedTier`) with the secret of `storage` (None: no
    secret) unless the tier is marked trusted; without a secret that raises ConfigError.
    What the config asks and the tier cannot do (a capacity below one block, a slab the host
    cannot allocate, a directory it cannot write) raises ConfigError naming the tier's key."""
    try:
        return _build_tier(index, tier_config, layout, pin_memory, storage, name or tier_config.kind)
    except ConfigError:
        raise
    except TierError as exc:  # the disk tier cannot create or scan its directory
        raise ConfigError(f"tiers[{index}].path", getattr(tier_config, "path", None), str(exc)) from exc
    except ValueError as exc:  # the constructors' own parameter checks
        if "capacity" in str(exc):  # below one block of this model's layout: the key the user sets
            raise ConfigError(f"tiers[{index}].capacity_bytes", tier_config.capacity_bytes, str(exc)) from exc
        raise ConfigError(f"tiers[{index}]", _shown_section(tier_config), str(exc)) from exc
    except (RuntimeError, MemoryError) as exc:  # the CPU slab could not be allocated
        raise ConfigError(f"tiers[{index}].capacity_bytes", tier_config.capacity_bytes,
                          f"could not allocate it ({exc}); lower it") from exc


def _shown_section(tier_config: "TierConfig") -> dict:
    from dataclasses import asdict

    return asdict(tier_config)


def _build_tier(index: int, tier_config: "TierConfig", layout: BlockLayout, pin_memory: bool | None,
                storage: "StorageConfig | None", name: str) -> StorageTier:
    quant_format = _quant_format(index, tier_config, layout)
    if tier_config.kind == "cpu":  # quantizes its slab itself (codes and scales move over PCIe as they are)
        return CpuTier(name, layout, tier_config.capacity_bytes, pin_memory=pin_memory, quant_format=quant_format)
    stored = layout if quant_format is None else packed_layout(layout, quant_format)
    sealer = sealer_for_tier(index, tier_config, storage or StorageConfig(), stored)
    tier = _build_store(index, tier_config, stored if sealer is None else sealer.sealed_layout, name)
    if sealer is not None:
        tier = SealedTier(tier, stored, sealer)
    return tier if quant_format is None else QuantizedTier(tier, layout, quant_format)


def _build_store(index: int, tier_config: "TierConfig", stored: BlockLayout, name: str) -> StorageTier:
    if tier_config.kind == "disk":
        from tierkv.storage.disk import DiskTier

        path = expand_path(tier_config.path, f"tiers[{index}].path")
        tier: StorageTier = DiskTier(name, stored, tier_config.capacity_bytes, path)
    elif tier_config.kind == "redis":
        from tierkv.storage.redis_tier import RedisTier

        tier = RedisTier(
            name, stored, tier_config.capacity_bytes, url=tier_config.url, namespace=tier_config.namespace,
            ttl_s=tier_config.ttl_s, timeout_s=tier_config.timeout_s, retry_interval_s=tier_config.retry_interval_s,
        )
    else:
        raise ValueError(f"tiers[{index}].kind: unknown tier kind {tier_config.kind!r}")
    return tier


def build_tiers(tier_configs: "list[TierConfig]", layout: BlockLayout, *, pin_memory: bool | None = None,
                storage: "StorageConfig | None" = None) -> TierChain:
    """The tier chain, in config order; `storage`: the deployment's secret (see `build_tier`). Tiers are named
    after their kind, a second of one kind "<kind>_2" (`distinct_tier_names`), so logs, errors, metrics and
    `prefix_blocks_by_tier` tell two disk tiers apart."""
    tiers = []
    names = distinct_tier_names([tier_config.kind for tier_config in tier_configs])
    try:
        for index, (tier_config, name) in enumerate(zip(tier_configs, names)):
            tiers.append(build_tier(index, tier_config, layout, pin_memory=pin_memory, storage=storage, name=name))
    except Exception:
        for tier in tiers:
            tier.close()
        raise
    return TierChain(tiers, write_through=[getattr(c, "write_through", False) for c in tier_configs])
