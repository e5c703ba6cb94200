"""Sealed disk and Redis tiers: forged, replayed, truncated, re-keyed and wrongly-keyed values are
misses counted as auth failures; names cannot be probed without the secret; secrets come from
the config and are required for untrusted tiers."""
from __future__ import annotations

import logging
import os
import stat

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.blocks import BlockLayout
from tierkv.config import ConfigError, load_config
from tierkv.storage import SealedTier, build_tiers
from tierkv.storage.auth import AuthFailure, BlockSealer, load_secret
from tierkv.storage.codec import decode_block, encode_block_bytes
from tierkv.storage.disk import DiskTier
from tierkv.storage.redis_tier import RedisTier

LAYOUT = BlockLayout(num_kv_heads=2, block_tokens=8, head_dim=32, dtype=torch.bfloat16)
SECRET_A = b"secret-a-0123456789abcdef"
SECRET_B = b"secret-b-0123456789abcdef"
KINDS = ["disk", pytest.param("redis", marks=pytest.mark.redis)]


def random_block() -> torch.Tensor:
    return torch.randint(0, 256, (LAYOUT.num_bytes,), dtype=torch.uint8).view(LAYOUT.dtype).reshape(LAYOUT.shape)


@pytest.fixture
def make_sealed(request, tmp_path):
    """make(secret, encrypt=False, place=0) -> SealedTier; one `place` is one directory or namespace."""
    made = []
    namespace = f"sealed-{os.getpid()}-{abs(hash(request.node.name))}"

    def make(secret: bytes, *, encrypt: bool = False, place: int = 0) -> SealedTier:
        sealer = BlockSealer(secret, LAYOUT, encrypt=encrypt)
        if request.node.callspec.params["kind"] == "disk":
            inner = DiskTier("disk", sealer.sealed_layout, 64 * sealer.num_bytes, tmp_path / f"disk{place}")
        else:
            url = request.getfixturevalue("redis_server").url
            inner = RedisTier("redis", sealer.sealed_layout, None, url=url, namespace=f"{namespace}-{place}")
        made.append(inner)
        return SealedTier(inner, LAYOUT, sealer)

    yield make
    for tier in made:
        tier.close()


def raw_store(tier: SealedTier):
    """The inner tier: where someone without the secret but with write access to the store acts."""
    return tier.inner


def assert_auth_miss(tier: SealedTier, key: str, num_failures: int) -> None:
    assert tier.get(key) is None
    snap = tier.counters.snapshot()
    assert snap["auth_failures"] == num_failures
    assert snap["hits"] + snap["misses"] == snap["lookups"]


@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "aead"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_genuine_block_replayed_under_another_key_is_a_counted_miss(make_sealed, kind, encrypt):
    tier = make_sealed(SECRET_A, encrypt=encrypt)
    real, victim = random_block(), random_block()
    assert tier.put("victim/L0", victim).ok and tier.put("other/L0", real).ok
    stolen = raw_store(tier).get(tier.sealer.name("other/L0"))
    assert raw_store(tier).put(tier.sealer.name("victim/L0"), stolen).ok
    assert_auth_miss(tier, "victim/L0", 1)
    assert not tier.contains("victim/L0")  # the forged value was dropped
    assert torch.equal(tier.get("other/L0").view(torch.uint8), real.view(torch.uint8))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "aead"])
@pytest.mark.parametrize("kind", ["disk"])
def test_any_altered_byte_is_a_counted_miss(make_sealed, kind, encrypt, data):
    tier = make_sealed(SECRET_A, encrypt=encrypt, place=data.draw(st.integers(0, 10**9)))
    assert tier.put("k/L1", random_block()).ok
    name = tier.sealer.name("k/L1")
    sealed = raw_store(tier).get(name).reshape(-1).clone()
    offset = data.draw(st.integers(0, sealed.numel() - 1))
    sealed[offset] ^= data.draw(st.integers(1, 255))
    raw_store(tier).put(name, sealed.view(tier.sealer.sealed_layout.shape))
    assert_auth_miss(tier, "k/L1", 1)


@pytest.mark.parametrize("kind", KINDS)
def test_truncated_values_are_misses_never_blocks(make_sealed, kind):
    tier = make_sealed(SECRET_A)
    assert tier.put("k/L0", random_block()).ok
    name = tier.sealer.name("k/L0")
    sealed = raw_store(tier).get(name).reshape(-1)
    # truncated, then padded back to the stored size so the store itself accepts it; the padding is the
    # complement of what was cut (zeros would equal the original wherever it held zeros: a byte of the
    # tag is 0 one time in 256, and the "truncated" value would then be the genuine one)
    for keep in (0, 64, 256, sealed.numel() - 32, sealed.numel() - 1):
        cut = 255 - sealed
        cut[:keep] = sealed[:keep]
        raw_store(tier).put(name, cut.view(tier.sealer.sealed_layout.shape))
        assert tier.get("k/L0") is None
    assert tier.counters["auth_failures"] == 5


@pytest.mark.redis
def test_redis_values_truncated_or_rekeyed_with_redis_py_are_misses(redis_server):
    import redis

    sealer = BlockSealer(SECRET_A, LAYOUT, encrypt=False)
    inner = RedisTier("redis", sealer.sealed_layout, None, url=redis_server.url, namespace=f"rekey-{os.getpid()}")
    tier = SealedTier(inner, LAYOUT, sealer)
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert tier.put("victim/L0", random_block()).ok and tier.put("other/L0", random_block()).ok
        victim, other = (f"{inner.namespace}:{sealer.name(k)}" for k in ("victim/L0", "other/L0"))
        value = client.get(other)
        # re-keyed: the codec's own key and CRC rewritten, so only the seal can tell
        block = decode_block(sealer.name("other/L0"), value)
        client.set(victim, encode_block_bytes(sealer.name("victim/L0"), block))
        assert tier.get("victim/L0") is None and tier.counters["auth_failures"] == 1
        client.set(victim, value[: len(value) // 2])  # truncated on the wire: the codec refuses it
        assert tier.get("victim/L0") is None and tier.counters["corrupt_blocks"] == 1
        assert tier.counters["hits"] == 0
    finally:
        client.close()
        tier.close()


@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "aead"])
@pytest.mark.parametrize("kind", KINDS)
def test_wrong_secret_neither_finds_nor_accepts_blocks(make_sealed, kind, encrypt):
    writer = make_sealed(SECRET_A, encrypt=encrypt)
    assert writer.put("k/L0", random_block()).ok
    reader = make_sealed(SECRET_B, encrypt=encrypt)  # another place: copy the value across
    assert not reader.contains("k/L0")
    sealed_by_a = raw_store(writer).get(writer.sealer.name("k/L0"))
    raw_store(reader).put(reader.sealer.name("k/L0"), sealed_by_a)
    assert_auth_miss(reader, "k/L0", 1)


@pytest.mark.parametrize("kind", KINDS)
def test_rotated_secret_turns_old_blocks_into_misses_and_new_ones_work(make_sealed, kind):
    old = make_sealed(SECRET_A)
    assert old.put("k/L0", random_block()).ok
    old.close()
    rotated = make_sealed(SECRET_B)  # the same directory / namespace, the new secret
    assert rotated.get("k/L0") is None and not rotated.contains("k/L0")
    fresh = random_block()
    assert rotated.put("k/L0", fresh).ok
    assert torch.equal(rotated.get("k/L0").view(torch.uint8), fresh.view(torch.uint8))


@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "aead"])
@pytest.mark.parametrize("kind", KINDS)
def test_public_keys_cannot_be_probed(make_sealed, kind, encrypt):
    tier = make_sealed(SECRET_A, encrypt=encrypt)
    keys = [f"{i:064x}/L{i % 3}" for i in range(6)]
    for key in keys:
        assert tier.put(key, random_block()).ok
    store = raw_store(tier)
    assert store.contains_many(keys) == [False] * len(keys)  # EXISTS on what anyone can compute
    assert store.get_many(keys) == [None] * len(keys)
    for key in keys:  # nor do the stored values name their keys
        value = bytes(store.get(tier.sealer.name(key)).reshape(-1).numpy())
        assert key.encode() not in value


def test_evicted_blocks_travel_down_the_chain_under_their_own_keys(tmp_path):
    config = load_config({
        "storage": {"secret": SECRET_A.decode()},
        "tiers": [{"kind": "cpu", "capacity_bytes": 2 * LAYOUT.num_bytes},
                  {"kind": "disk", "path": str(tmp_path / "d1"), "capacity_bytes": 3 * LAYOUT.num_bytes + 3 * 288},
                  {"kind": "disk", "path": str(tmp_path / "d2"), "capacity_bytes": "1MiB", "encrypt": True}],
    }, env={})
    chain = build_tiers(config.tiers, LAYOUT, storage=config.storage)
    blocks = {f"k{i}/L0": random_block() for i in range(10)}
    with chain.tiers[0]:
        chain.put_many(list(blocks), list(blocks.values()))
        chain.flush()
        assert chain.tiers[2].counters["puts"] > 0
        got = chain.get_many(list(blocks), promote=False)
        assert all(g is not None and torch.equal(g.view(torch.uint8), b.view(torch.uint8))
                   for g, b in zip(got, blocks.values()))
        assert sum(t.counters["auth_failures"] for t in chain.tiers) == 0
    chain.close()


# -- the secret ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("tier", [{"kind": "disk"}, {"kind": "redis"}])
def test_untrusted_tier_without_a_secret_is_a_start_up_error(tmp_path, tier):
    tier = dict(tier, **({"path": str(tmp_path)} if tier["kind"] == "disk" else {}))
    config = load_config({"tiers": [{"kind": "cpu"}, tier]}, env={})
    with pytest.raises(ConfigError) as err:
        build_tiers(config.tiers, LAYOUT, storage=config.storage)
    message = str(err.value)
    for name in ("storage.secret_file", "TIERKV_STORAGE__SECRET", "TIERKV_STORAGE__SECRET_FILE", "trusted: true"):
        assert name in message
    with pytest.raises(ConfigError):
        build_tiers(config.tiers, LAYOUT)  # no storage section given at all: the same


def test_trusted_disk_tier_needs_no_secret_and_stores_plain_blocks(tmp_path):
    config = load_config({"tiers": [{"kind": "cpu"}, {"kind": "disk", "path": str(tmp_path), "trusted": True}]}, env={})
    chain = build_tiers(config.tiers, LAYOUT, storage=config.storage)
    assert isinstance(chain.tiers[1], DiskTier)
    chain.close()
    with pytest.raises(ConfigError, match="tiers\\[1\\].encrypt"):
        config.tiers[1].encrypt = True
        build_tiers(config.tiers, LAYOUT, storage=config.storage)


def test_secret_from_the_environment_and_from_a_file(tmp_path):
    env_config = load_config({}, env={"TIERKV_STORAGE__SECRET": "from-the-environment-123"})
    assert load_secret(env_config.storage) == b"from-the-environment-123"
    path = tmp_path / "secret"
    path.write_text("from-a-file-0123456789\n")
    path.chmod(0o600)
    file_config = load_config({}, env={"TIERKV_STORAGE__SECRET_FILE": str(path)})
    assert load_secret(file_config.storage) == b"from-a-file-0123456789"
    path.chmod(0o640)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_secret(file_config.storage)
    path.chmod(0o600)
    path.write_text("short")
    with pytest.raises(ConfigError, match="at least 16"):
        load_secret(file_config.storage)
    with pytest.raises(ConfigError, match="storage.secret"):
        load_config({"storage": {"secret": "short"}}, env={})
    with pytest.raises(ConfigError, match="create_secret_file"):
        load_secret(load_config({"storage": {"secret_file": str(tmp_path / "missing")}}, env={}).storage)


def test_created_secret_file_is_private_random_and_stable(tmp_path):
    path = tmp_path / "conf" / "tierkv" / "secret"
    config = load_config({"storage": {"secret_file": str(path), "create_secret_file": True}}, env={})
    first = load_secret(config.storage)
    assert len(first) == 64 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_secret(config.storage) == first
    other = tmp_path / "elsewhere" / "secret"
    assert load_secret(load_config({"storage": {"secret_file": str(other), "create_secret_file": True}},
                                   env={}).storage) != first
    assert not [p for p in path.parent.iterdir() if p.name != "secret"]  # no temporary file left


def test_failures_are_logged_at_most_once_per_interval(tmp_path, caplog):
    sealer = BlockSealer(SECRET_A, LAYOUT, encrypt=False)
    tier = SealedTier(DiskTier("disk", sealer.sealed_layout, 64 * sealer.num_bytes, tmp_path), LAYOUT, sealer, log_interval_s=3600)
    forged = torch.zeros(sealer.sealed_layout.shape, dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, logger="tierkv.storage.sealed"):
        for i in range(20):
            tier.inner.put(sealer.name(f"k{i}/L0"), forged)
            assert tier.get(f"k{i}/L0") is None
    assert tier.counters["auth_failures"] == 20
    assert len([r for r in caplog.records if "failed authentication" in r.message]) == 1
    tier.close()


def test_sealer_refuses_keys_that_do_not_fit_and_wrong_sizes():
    sealer = BlockSealer(SECRET_A, LAYOUT, encrypt=False)
    with pytest.raises(ValueError, match="up to 176"):
        sealer.seal("x" * 177, random_block())
    with pytest.raises(AuthFailure):
        sealer.open("k", torch.zeros(sealer.num_bytes - 2, dtype=torch.uint8))


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_quantized_tiers_are_sealed_too(tmp_path, fmt):
    config = load_config({"storage": {"secret": SECRET_A.decode()},
                          "tiers": [{"kind": "cpu"}, {"kind": "disk", "path": str(tmp_path), "storage_dtype": fmt}]},
                         env={})
    chain = build_tiers(config.tiers, LAYOUT, storage=config.storage)
    tier = chain.tiers[1]
    assert isinstance(tier.inner, SealedTier)
    block = torch.randn(LAYOUT.shape).to(LAYOUT.dtype)
    assert tier.put("k/L0", block).ok
    assert (tier.get("k/L0").float() - block.float()).abs().max() < 0.2 * block.float().abs().max()
    tier.inner.inner.put(tier.inner.sealer.name("k/L0"), torch.zeros(tier.inner.sealer.sealed_layout.shape,
                                                                      dtype=torch.uint8))
    assert tier.get("k/L0") is None and tier.counters["auth_failures"] == 1
    chain.close()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(forged=st.sets(st.integers(0, 7)), threads=st.sampled_from([1, 4]), encrypt=st.booleans())
def test_a_batch_opened_on_sealing_threads_keeps_order_and_misses_only_the_forged(tmp_path_factory, forged, threads,
                                                                                  encrypt):
    sealer = BlockSealer(SECRET_A, LAYOUT, encrypt=encrypt)
    inner = DiskTier("disk", sealer.sealed_layout, 64 * sealer.num_bytes, tmp_path_factory.mktemp("batch"))
    tier = SealedTier(inner, LAYOUT, sealer, seal_threads=threads)
    try:
        keys = [f"k{i}/L0" for i in range(8)]
        blocks = [random_block() for _ in keys]
        assert all(r.ok for r in tier.put_many(keys, blocks))
        for i in forged:  # a genuine value of another key under this key's name: a replay
            other = (i + 1) % 8
            inner.put(sealer.name(keys[i]), inner.get(sealer.name(keys[other])))
        got = tier.get_many(keys)
        for i, (block, found) in enumerate(zip(blocks, got)):
            if i in forged:
                assert found is None
            else:
                assert found is not None and torch.equal(found.view(torch.uint8), block.view(torch.uint8))
        assert tier.counters["auth_failures"] == len(forged)
    finally:
        tier.close()


def test_a_secret_file_another_user_owns_or_can_replace_is_refused(tmp_path, monkeypatch):
    """Whoever owns the secret file (or a symlink to it, or its directory), or can replace it in a directory
    writable by others, knows the secret: refused. Ownership is seen through os.geteuid (the tests run as
    one user: as root the file is given to another uid, otherwise this process's uid reads as another)."""
    import os

    path = tmp_path / "secret"
    path.write_text("from-a-file-0123456789\n")
    path.chmod(0o600)
    config = load_config({}, env={"TIERKV_STORAGE__SECRET_FILE": str(path)})
    assert load_secret(config.storage) == b"from-a-file-0123456789"
    real = os.geteuid()
    if real == 0:  # root: give the file to another user
        os.chown(path, 4242, -1)
        owner = 4242
    else:  # this user's file, read as another user's
        monkeypatch.setattr(os, "geteuid", lambda: real + 4242)
        owner = real
    with pytest.raises(ConfigError, match=f"the file is owned by uid {owner}"):
        load_secret(config.storage)
    monkeypatch.setattr(os, "geteuid", lambda: real)
    if real == 0:
        os.chown(path, 0, -1)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # no sticky bit: anyone can rename the file away and put theirs
    moved = shared / "secret"
    path.rename(moved)
    with pytest.raises(ConfigError, match="its directory is writable by group or others"):
        load_secret(load_config({}, env={"TIERKV_STORAGE__SECRET_FILE": str(moved)}).storage)
    shared.chmod(0o1777)  # sticky, as /tmp: only the owner may replace it
    assert load_secret(load_config({}, env={"TIERKV_STORAGE__SECRET_FILE": str(moved)}).storage)


def test_an_inline_secret_counts_bytes_without_surrounding_whitespace_and_made_directories_are_private(tmp_path):
    import stat

    with pytest.raises(ConfigError, match="at least 16 bytes besides surrounding whitespace, got 5"):
        load_config({"storage": {"secret": "       short        "}}, env={})
    assert load_config({"storage": {"secret": "é" * 8}}, env={})  # 16 bytes in UTF-8
    path = tmp_path / "a" / "b" / "c" / "secret"
    load_secret(load_config({"storage": {"secret_file": str(path), "create_secret_file": True}}, env={}).storage)
    for directory in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700


@pytest.mark.parametrize("kind", KINDS)
def test_peers_sealing_the_two_ways_leave_each_others_blocks_alone(make_sealed, kind):
    """encrypt: false and true on one secret and one store (a move to encryption, peers on both sides):
    each misses the other's blocks without an authentication failure, so neither deletes them (one name
    for both modes had the reader fail on the block and delete it)."""
    mac, aead = make_sealed(SECRET_A), make_sealed(SECRET_A, encrypt=True)
    written = {"mac": random_block(), "aead": random_block()}
    assert mac.put("k/L0", written["mac"]).ok and aead.put("k/L1", written["aead"]).ok
    assert aead.get("k/L0") is None and mac.get("k/L1") is None
    assert mac.counters.snapshot()["auth_failures"] == aead.counters.snapshot()["auth_failures"] == 0
    assert torch.equal(mac.get("k/L0").view(torch.uint8), written["mac"].view(torch.uint8))
    assert torch.equal(aead.get("k/L1").view(torch.uint8), written["aead"].view(torch.uint8))
    assert BlockSealer(SECRET_A, LAYOUT, encrypt=False).name("k/L0") != BlockSealer(SECRET_A, LAYOUT, encrypt=True).name("k/L0")


def test_a_secret_file_under_an_unknown_users_home_names_the_key():
    """`~nosuchuser/...` cannot be expanded: a start says which key, as `tierkv config check` does."""
    from tierkv.config import ConfigError
    from tierkv.config.schema import StorageConfig
    from tierkv.storage.auth import load_secret

    with pytest.raises(ConfigError, match="storage.secret_file.*cannot expand it"):
        load_secret(StorageConfig(secret_file="~nosuchuser-tierkv/secret"))


class _NoOverlapAead:
    """AES-GCM that refuses an output overlapping its input, as cryptography 51 does (48 allowed it)."""

    def __init__(self, aead):
        self.aead = aead

    @staticmethod
    def _check(data, buf) -> None:
        import numpy as np

        if np.shares_memory(np.frombuffer(data, dtype=np.uint8), np.frombuffer(buf, dtype=np.uint8)):
            raise ValueError("data and buf must not overlap")

    def encrypt_into(self, nonce, data, aad, buf):
        self._check(data, buf)
        return self.aead.encrypt_into(nonce, data, aad, buf)

    def decrypt_into(self, nonce, data, aad, buf):
        self._check(data, buf)
        return self.aead.decrypt_into(nonce, data, aad, buf)


@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "aead"])
def test_sealing_never_encrypts_in_place(encrypt):
    """Under cryptography 51 every encrypted put failed (the block was encrypted in place): the sealer's
    buffers never overlap, and a block sealed so opens to itself."""
    layout = BlockLayout(num_kv_heads=2, block_tokens=16, head_dim=64, dtype=torch.bfloat16)
    sealer = BlockSealer(b"s" * 32, layout, encrypt=encrypt)
    sealer._aead = _NoOverlapAead(sealer._aead)
    block = torch.randn(layout.shape).to(torch.bfloat16)
    stored_key, back = sealer.open("k", sealer.seal("k", block))
    assert stored_key == "k" and torch.equal(back, block)
