#!/usr/bin/env python
"""Do the storage tiers move 256 KiB blocks at >= 70% of their medium's raw speed? (CPU only)

Each tier's batched put_many / get_many (--batch-blocks per call) over --total-mib of 256 KiB
blocks ([2, 8 kv heads, 64 tokens, 128 dims] bf16), next to a raw ceiling on the same bytes in
the same run; tier and ceiling alternate rep by rep, median of --reps after one warm-up each:

    tier   op        tier pass                          ceiling
    cpu    put/get   put_many / get_many                one torch copy_ per block between
                                                        preallocated tensors
    disk   put+sync  put_many, then os.sync()           O_DIRECT write, 16 MiB chunks, + fsync
           get cold  get_many after drop_caches         O_DIRECT read, 16 MiB chunks
           put       put_many (page cache only)         buffered write of one file
           get warm  get_many (page cache)              buffered read of that file, warm
    redis  put/get   put_many / get_many                pipelined raw SET / GET, same server

Every put pass writes keys the tier does not hold (all removed, untimed, before each pass; disk
also syncs there), the common case for content-addressed blocks. References (no target), cpu:
one contiguous copy_ of all bytes; for get, a clone per block with a batch of clones alive.
Target: tier >= 70% of ceiling on every row. The script reports and does not assert: it exits 0
whatever the ratios (non-zero only when a tier returns wrong bytes or fails a put).
Without --redis-url it starts redis-server on a free loopback port (--save "" --appendonly no)
and stops it at the end. Disk files live in a temp dir under --disk-path, removed at the end.
Cold reads write /proc/sys/vm/drop_caches (root only; --no-drop-caches to leave it alone).

    python benchmarks/bench_storage.py --out benchmarks/results/storage-cpu-vm.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import mmap
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from _common import write_results  # noqa: E402

from tierkv.blocks import BlockLayout, block_key  # noqa: E402
from tierkv.storage import CpuTier  # noqa: E402

LAYOUT = BlockLayout(num_kv_heads=8, block_tokens=64, head_dim=128, dtype=torch.bfloat16)  # 256 KiB
TARGET_RATIO = 0.70
MIB = 1024 * 1024
DIRECT_CHUNK_BYTES = 16 * MIB
REDIS_START_DEADLINE_S = 10.0
REDIS_TIMEOUT_S = 30.0  # generous: a 16 MiB pipeline on a loaded VM must not mark the tier down

Pass = Callable[[], object]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = Path(__file__).resolve().parent / "results" / f"storage-{socket.gethostname()}.json"
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--total-mib", type=int, default=256, help="bytes moved per measurement")
    parser.add_argument("--batch-blocks", type=int, default=64, help="blocks per put_many/get_many")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tiers", nargs="+", choices=["cpu", "disk", "redis", "auth"],
                        default=["cpu", "disk", "redis", "auth"])
    parser.add_argument("--redis-url", default=None, help="use this server (default: start one)")
    parser.add_argument("--disk-path", type=Path, default=Path("/var/tmp"), help="parent of the temp dir")
    parser.add_argument("--no-drop-caches", action="store_true", help="never drop the page cache")
    args = parser.parse_args()
    if args.total_mib * MIB < LAYOUT.num_bytes or args.batch_blocks < 1 or args.reps < 1:
        parser.error("--total-mib must hold one 256 KiB block; --batch-blocks and --reps must be >= 1")
    return args


# -- timing ----------------------------------------------------------------------------------
def seconds(run: Pass, before: Pass | None = None) -> float:
    if before is not None:
        before()
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def side_by_side(
    tier_pass: Pass, ceiling_pass: Pass, reps: int, *,
    before_tier: Pass | None = None, before_ceiling: Pass | None = None,
) -> tuple[list[float], list[float]]:  # fmt: skip
    """Seconds per rep of both passes after one warm-up each; who goes first alternates per rep.

    before_tier / before_ceiling run untimed ahead of every timed pass of that side.
    """
    tier_pass()
    ceiling_pass()
    tier_s, ceiling_s = [], []
    for rep in range(reps):
        order = [(tier_pass, before_tier, tier_s), (ceiling_pass, before_ceiling, ceiling_s)]
        for run, before, times in order if rep % 2 == 0 else order[::-1]:
            times.append(seconds(run, before))
    return tier_s, ceiling_s


def median_gb_s(num_bytes: int, times_s: list[float]) -> float:
    return num_bytes / statistics.median(times_s) / 1e9


def reference_gb_s(run: Pass, num_bytes: int, reps: int) -> float:
    """A pass with no tier beside it (no target): median of `reps` after one warm-up."""
    run()
    return median_gb_s(num_bytes, [seconds(run) for _ in range(reps)])


def make_row(tier: str, op: str, num_bytes: int, times: tuple[list, list], ceiling: str, **extra) -> dict:
    tier_s, ceiling_s = times
    tier_gb_s, ceiling_gb_s = median_gb_s(num_bytes, tier_s), median_gb_s(num_bytes, ceiling_s)
    ratio = tier_gb_s / ceiling_gb_s
    return {
        "tier": tier, "op": op, "num_bytes": num_bytes,
        "tier_gb_s": tier_gb_s, "ceiling": ceiling, "ceiling_gb_s": ceiling_gb_s,
        "ratio": ratio, "target_ratio": TARGET_RATIO, "passed": ratio >= TARGET_RATIO,
        "tier_s": tier_s, "ceiling_s": ceiling_s, **extra,
    }  # fmt: skip


# -- tier passes -----------------------------------------------------------------------------
def put_pass(tier, batches: list[tuple[list[str], list[torch.Tensor]]]) -> Pass:
    def run() -> None:
        for keys, blocks in batches:
            failed = [r.error for r in tier.put_many(keys, blocks) if not r.ok]
            if failed:
                raise SystemExit(f"bench_storage.py: {tier.name} put failed: {failed[0]}")

    return run


def get_pass(tier, key_batches: list[list[str]]) -> Pass:
    def run() -> None:
        for keys in key_batches:
            tier.get_many(keys)

    return run


def check_bytes(tier, keys: list[str], blocks: list[torch.Tensor]) -> None:
    """Every block reads back exactly as written (untimed)."""
    got = tier.get_many(keys)
    for key, block, back in zip(keys, blocks, got):
        if back is None or not torch.equal(back.view(torch.uint8), block.view(torch.uint8)):
            raise SystemExit(f"bench_storage.py: {tier.name} returned wrong bytes or a miss for {key}")


def split(keys: list[str], blocks: list[torch.Tensor], size: int):
    return [(keys[i : i + size], blocks[i : i + size]) for i in range(0, len(keys), size)]


# -- cpu -------------------------------------------------------------------------------------
def bench_cpu(keys: list[str], blocks: list[torch.Tensor], data: torch.Tensor, args) -> list[dict]:
    num_bytes = data.numel() * data.element_size()
    batches = split(keys, blocks, args.batch_blocks)
    tier = CpuTier("cpu", LAYOUT, num_bytes)
    slab = LAYOUT.empty(len(blocks), pin_memory=tier.is_pinned)  # what the ceiling copies into
    out = LAYOUT.empty(len(blocks))  # get's ceiling writes here; the tier allocates instead
    slots = range(len(blocks))

    def copy_in() -> None:
        for i in slots:
            slab[i].copy_(blocks[i])

    def copy_out() -> None:
        for i in slots:
            out[i].copy_(slab[i])

    def clone_out() -> None:  # like get_many: a batch of fresh tensors alive at once
        for start in range(0, len(blocks), args.batch_blocks):
            list(map(torch.clone, slab[start : start + args.batch_blocks].unbind(0)))

    try:
        put_times = side_by_side(
            put_pass(tier, batches), copy_in, args.reps, before_tier=lambda: tier.remove_many(keys)
        )
        check_bytes(tier, keys, blocks)
        get_times = side_by_side(get_pass(tier, [k for k, _ in batches]), copy_out, args.reps)
        contiguous = reference_gb_s(lambda: slab.copy_(data), num_bytes, args.reps)
        clone = reference_gb_s(clone_out, num_bytes, args.reps)
    finally:
        tier.close()
    pinned = {"slab_pinned": tier.is_pinned}
    return [
        make_row("cpu", "put", num_bytes, put_times, "copy_ per block", contiguous_copy_gb_s=contiguous, **pinned),
        make_row("cpu", "get", num_bytes, get_times, "copy_ per block", contiguous_copy_gb_s=contiguous,
                 clone_batch_gb_s=clone, **pinned),
    ]  # fmt: skip


# -- disk ------------------------------------------------------------------------------------
def drop_page_cache() -> bool:
    """Write back dirty pages, then drop clean ones; False where /proc/sys/vm is not writable."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError:
        return False
    return True


def unlink(path: Path) -> None:
    """Remove `path` if it exists and sync, so a timed write starts with no dirty pages."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.sync()


def write_file(path: Path, buf: mmap.mmap, direct: bool) -> None:
    """A fresh file from `buf` in 16 MiB chunks; direct: O_DIRECT then fsync (dd oflag=direct conv=fsync)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0), 0o644)
    try:
        with memoryview(buf) as view:
            for offset in range(0, len(view), DIRECT_CHUNK_BYTES):
                chunk = view[offset : offset + DIRECT_CHUNK_BYTES]
                if os.write(fd, chunk) != len(chunk):
                    raise OSError(f"short write to {path}")
        if direct:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path: Path, buf: mmap.mmap, direct: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        with memoryview(buf) as view:
            for offset in range(0, len(view), DIRECT_CHUNK_BYTES):
                chunk = view[offset : offset + DIRECT_CHUNK_BYTES]
                if os.preadv(fd, [chunk], offset) != len(chunk):
                    raise OSError(f"short read from {path}")
    finally:
        os.close(fd)


def bench_disk(keys, blocks, data: torch.Tensor, args, workdir: Path) -> list[dict]:
    from tierkv.storage.disk import DiskTier

    num_bytes = data.numel() * data.element_size()
    batches = split(keys, blocks, args.batch_blocks)
    tier = DiskTier("disk", LAYOUT, num_bytes, workdir / "tier")
    buf = mmap.mmap(-1, num_bytes)  # page-aligned, as O_DIRECT needs
    torch.frombuffer(buf, dtype=torch.uint8).copy_(data.view(-1).view(torch.uint8))
    direct, buffered = workdir / "direct.bin", workdir / "buffered.bin"
    put, get = put_pass(tier, batches), get_pass(tier, [k for k, _ in batches])
    is_cold = not args.no_drop_caches and drop_page_cache()

    def empty_tier() -> None:  # before each put: new files, no dirty pages
        tier.remove_many(keys)
        os.sync()

    drop = drop_page_cache if is_cold else None
    try:
        put_sync = side_by_side(
            lambda: (put(), os.sync()), lambda: write_file(direct, buf, True), args.reps,
            before_tier=empty_tier, before_ceiling=lambda: unlink(direct),
        )  # fmt: skip
        check_bytes(tier, keys, blocks)
        read_direct = lambda: read_file(direct, buf, True)  # noqa: E731
        cold = side_by_side(get, read_direct, args.reps, before_tier=drop, before_ceiling=drop)
        put_cached = side_by_side(
            put, lambda: write_file(buffered, buf, False), args.reps,
            before_tier=empty_tier, before_ceiling=lambda: unlink(buffered),
        )  # fmt: skip
        get_warm = side_by_side(get, lambda: read_file(buffered, buf, False), args.reps)
    finally:
        tier.close()
        buf.close()
    where = {"path": str(workdir)}
    return [
        make_row("disk", "put+sync", num_bytes, put_sync, "O_DIRECT write+fsync", **where),
        make_row("disk", "get cold" if is_cold else "get", num_bytes, cold, "O_DIRECT read",
                 is_cold=is_cold, **where),
        make_row("disk", "put", num_bytes, put_cached, "buffered write", **where),
        make_row("disk", "get warm", num_bytes, get_warm, "buffered read warm", **where),
    ]  # fmt: skip


# -- redis -----------------------------------------------------------------------------------
@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    """A redis-server child on a free loopback port, no persistence; yields its URL, stops it after."""
    import redis

    executable = shutil.which("redis-server")
    if executable is None:
        raise FileNotFoundError("redis-server is not on PATH (apt-get install redis-server)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workdir.mkdir()
    command = [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(workdir), "--logfile", str(workdir / "redis.log")]  # fmt: skip
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client, deadline = redis.Redis(port=port, socket_timeout=1.0), time.monotonic() + REDIS_START_DEADLINE_S
        while not _answers_ping(client):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not start; see {workdir / 'redis.log'}")
            time.sleep(0.02)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _answers_ping(client) -> bool:
    try:
        return bool(client.ping())
    except Exception:  # not listening yet
        return False


def bench_redis(keys, blocks, data: torch.Tensor, args, url: str) -> list[dict]:
    import redis

    from tierkv.storage.redis_tier import RedisTier

    num_bytes = data.numel() * data.element_size()
    batches = split(keys, blocks, args.batch_blocks)
    namespace = f"tierkv-bench-{os.getpid()}"
    tier = RedisTier("redis", LAYOUT, num_bytes, url=url, namespace=namespace, timeout_s=REDIS_TIMEOUT_S)
    raw = redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S)
    raw_keys = [f"{namespace}:raw:{k}" for k in keys]
    values = [memoryview(b.view(torch.uint8).reshape(-1).numpy()) for b in blocks]  # the same bytes, no copy
    raw_batches = split(raw_keys, values, args.batch_blocks)

    def raw_set() -> None:
        for batch_keys, batch_values in raw_batches:
            pipe = raw.pipeline(transaction=False)
            for key, value in zip(batch_keys, batch_values):
                pipe.set(key, value)
            pipe.execute()

    def raw_get() -> None:
        for batch_keys, _ in raw_batches:
            pipe = raw.pipeline(transaction=False)
            for key in batch_keys:
                pipe.get(key)
            if any(v is None for v in pipe.execute()):
                raise SystemExit("bench_storage.py: raw GET missed a key it had SET")

    def delete_raw() -> None:
        for batch_keys, _ in raw_batches:
            raw.delete(*batch_keys)

    try:  # before each put pass, that side's keys are deleted: every SET writes a new key
        put_times = side_by_side(
            put_pass(tier, batches), raw_set, args.reps,
            before_tier=lambda: tier.remove_many(keys), before_ceiling=delete_raw,
        )  # fmt: skip
        check_bytes(tier, keys, blocks)
        get_times = side_by_side(get_pass(tier, [k for k, _ in batches]), raw_get, args.reps)
        version = raw.info("server").get("redis_version")
    finally:
        with contextlib.suppress(Exception):  # leave nothing behind on a server we did not start
            tier.remove_many(keys)
            delete_raw()
        tier.close()
        raw.close()
    where = {"redis_version": version, "hiredis": _has_hiredis()}
    return [
        make_row("redis", "put", num_bytes, put_times, "pipelined SET", **where),
        make_row("redis", "get", num_bytes, get_times, "pipelined GET", **where),
    ]


def bench_auth(keys: list[str], blocks: list[torch.Tensor], args) -> list[dict]:
    """What sealing costs a shared tier's value, against the plain codec in the same run (no I/O).

    encode: plain = codec.encode_block_bytes(key, block); mac / mac+encrypt = BlockSealer.seal
    (HMAC-SHA256, or AES-256-GCM) then the codec, as SealedTier puts through Redis.
    decode: plain = codec.decode_block_into; sealed = the codec into the sealed row, then open.
    """
    from tierkv.storage.auth import BlockSealer
    from tierkv.storage.codec import decode_block_into, encode_block_bytes

    num_bytes = len(blocks) * LAYOUT.num_bytes
    plain_values = [encode_block_bytes(k, b) for k, b in zip(keys, blocks)]
    out = LAYOUT.empty(1)[0]

    def plain_encode() -> None:
        for k, b in zip(keys, blocks):
            encode_block_bytes(k, b)

    def plain_decode() -> None:
        for k, v in zip(keys, plain_values):
            decode_block_into(k, v, out)

    rows = []
    for mode, encrypt in (("mac", False), ("mac+encrypt", True)):
        sealer = BlockSealer(b"bench-secret-0123456789abcdef", LAYOUT, encrypt=encrypt)
        names = [sealer.name(k) for k in keys]
        sealed_values = [encode_block_bytes(n, sealer.seal(k, b)) for n, k, b in zip(names, keys, blocks)]
        row = sealer.sealed_layout.empty(1)[0]

        def sealed_encode() -> None:
            for n, k, b in zip(names, keys, blocks):
                encode_block_bytes(n, sealer.seal(k, b))

        def sealed_decode() -> None:
            for n, k, v in zip(names, keys, sealed_values):
                decode_block_into(n, v, row)
                sealer.open(k, row)

        for op, sealed_pass, plain_pass in (("encode", sealed_encode, plain_encode),
                                            ("decode", sealed_decode, plain_decode)):
            rows.append(make_row("auth", f"{op} {mode}", num_bytes, side_by_side(sealed_pass, plain_pass, args.reps),
                                 f"plain codec {op} of the same blocks", mode=mode))
        start = time.perf_counter()
        for k in keys * 64:
            sealer.name(k)
        rows[-1]["name_us_per_key"] = (time.perf_counter() - start) / (64 * len(keys)) * 1e6
        rows += _sealed_tier_rows(sealer, mode, keys, blocks, args)
    return rows


def _sealed_tier_rows(sealer, mode: str, keys: list[str], blocks: list[torch.Tensor], args) -> list[dict]:
    """SealedTier.put_many / get_many of the whole batch on its sealing threads against the same
    tier on one thread (inner tier: CPU memory, so the sealer is what is timed)."""
    from tierkv.storage.cpu import CpuTier
    from tierkv.storage.sealed import SEAL_THREADS, SealedTier

    num_bytes = len(blocks) * LAYOUT.num_bytes
    threads = 1 if sealer.encrypt else SEAL_THREADS  # SealedTier's own rule: AES-GCM stays on one thread
    tiers = [SealedTier(CpuTier("cpu", sealer.sealed_layout, 2 * len(blocks) * sealer.num_bytes, pin_memory=False),
                        LAYOUT, sealer, seal_threads=n) for n in (threads, 1)]
    try:
        for tier in tiers:  # the blocks are there for get_many
            tier.put_many(keys, blocks)
        rows = []
        for op, run in (("put_many", lambda t: t.put_many(keys, blocks)), ("get_many", lambda t: t.get_many(keys))):
            times = side_by_side(lambda: run(tiers[0]), lambda: run(tiers[1]), args.reps)
            rows.append(make_row("auth", f"SealedTier {op} {mode}", num_bytes, times, "the same on one thread",
                                 mode=mode, seal_threads=threads))
        return rows
    finally:
        for tier in tiers:
            tier.close()


def _has_hiredis() -> bool:
    try:
        import hiredis  # noqa: F401
    except ImportError:
        return False
    return True


# -- main ------------------------------------------------------------------------------------
def make_blocks(num_blocks: int) -> tuple[list[str], list[torch.Tensor], torch.Tensor]:
    """Random blocks with realistic keys ("<64 hex>/L0"); `data` holds them contiguously."""
    data = LAYOUT.empty(num_blocks)  # [num_blocks, 2, 8, 64, 128] bf16
    data.view(torch.uint8).random_(0, 256)
    keys = [block_key(hashlib.sha256(i.to_bytes(8, "little")).hexdigest(), 0) for i in range(num_blocks)]
    return keys, list(data.unbind(0)), data


def run_tiers(args, workdir: Path) -> tuple[list[dict], dict[str, str]]:
    keys, blocks, data = make_blocks(args.total_mib * MIB // LAYOUT.num_bytes)
    rows, skipped = [], {}
    for name in args.tiers:
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        try:
            if name == "cpu":
                rows += bench_cpu(keys, blocks, data, args)
            elif name == "disk":
                rows += bench_disk(keys, blocks, data, args, workdir)
            elif name == "auth":
                rows += bench_auth(keys, blocks, args)
            elif args.redis_url is not None:
                rows += bench_redis(keys, blocks, data, args, args.redis_url)
            else:
                with redis_server(workdir / "redis") as url:
                    rows += bench_redis(keys, blocks, data, args, url)
        except (ImportError, FileNotFoundError, RuntimeError) as exc:
            skipped[name] = f"{type(exc).__name__}: {exc}"
            print(f"skipped {name}: {skipped[name]}", file=sys.stderr)
    return rows, skipped


def print_table(rows: list[dict], skipped: dict[str, str]) -> None:
    print(f"{'tier':<6} {'op':<9} {'tier GB/s':>9} {'ceiling GB/s':>12} {'ratio':>6} {'target':>6}  result  ceiling")
    for r in rows:
        print(
            f"{r['tier']:<6} {r['op']:<9} {r['tier_gb_s']:>9.2f} {r['ceiling_gb_s']:>12.2f} {r['ratio']:>6.2f}"
            f" {r['target_ratio']:>6.2f}  {'pass' if r['passed'] else 'FAIL':<6}  {r['ceiling']}"
        )
    for name, reason in skipped.items():
        print(f"{name:<6} skipped: {reason}")


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below on kill
    workdir = Path(tempfile.mkdtemp(prefix="tierkv-bench-storage-", dir=args.disk_path))
    try:
        rows, skipped = run_tiers(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results = {
        "block_bytes": LAYOUT.num_bytes,
        "total_bytes": args.total_mib * MIB // LAYOUT.num_bytes * LAYOUT.num_bytes,
        "batch_blocks": args.batch_blocks,
        "reps": args.reps,
        "hostname": socket.gethostname(),
        "num_cpus": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "rows": rows,
        "skipped": skipped,
    }
    write_results(args.out, results)
    print(f"wrote {args.out}")
    print_table(rows, skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
