"""Someone with write access to the shared Redis (redis-py alone, no secret) tries to choose what a
victim's model attends to. Against a trusted tier the attack works (the control); against a
sealed tier the victim's tokens equal the run without tiers and the forged blocks are counted."""
from __future__ import annotations

import uuid

import pytest
import torch

from tests.models import build, reference_greedy
from tierkv.blocks import block_keys_for_prompt
from tierkv.config import load_config
from tierkv.llm import TieredLLM
from tierkv.storage.auth import BlockSealer
from tierkv.storage.codec import decode_block, encode_block_bytes

pytestmark = pytest.mark.redis

BLOCK_TOKENS = 4
BLOCK_BYTES = 2 * 2 * BLOCK_TOKENS * 16 * 4  # K+V, 2 kv heads, head_dim 16, fp32
SECRET = "deployment-secret-0123456789"
NEW_TOKENS = 8
CPU_BLOCKS = 80  # one 128-token request of the 2-layer model (66 blocks): two more push it into Redis


def victim_llm(redis_url: str, namespace: str, *, trusted: bool, encrypt: bool = False):
    """A fresh process: its own model copy and CPU tier; only Redis is shared."""
    model, _ = build("llama", seed=0)
    redis_tier = {"kind": "redis", "url": redis_url, "namespace": namespace, "trusted": trusted}
    if encrypt:
        redis_tier["encrypt"] = True
    config = load_config({
        "model": {"name": "shared-llama"},
        "cache": {"block_tokens": BLOCK_TOKENS, "gpu_budget_bytes": 2 * 6 * BLOCK_BYTES, "sink_tokens": 4,
                  "window_tokens": 8},
        "tiers": [{"kind": "cpu", "capacity_bytes": CPU_BLOCKS * BLOCK_BYTES}, redis_tier],
        "storage": {} if trusted else {"secret": SECRET},
        "scheduler": {"lookahead_layers": 1, "staging_bytes": 2 * 4 * BLOCK_BYTES, "prefill_chunk_tokens": 64},
    }, env={})
    return TieredLLM(model, config, show_progress=False)


def generate(llm: TieredLLM, prompt: list[int]):
    """Tokens for `prompt`, then two unrelated requests that spill its blocks to Redis; the Redis figures."""
    with llm:
        (out,) = llm.generate([prompt], max_new_tokens=NEW_TOKENS)
        for seed in (1, 2):
            filler = torch.randint(0, 512, (128,), generator=torch.Generator().manual_seed(seed)).tolist()
            llm.generate([filler], max_new_tokens=1)
        llm.runtime.chain.flush()
        stats = llm.stats()
    redis_stats = next(t for t in stats["tiers"] if t["tier"] == "redis")
    return out, redis_stats


def public_keys(llm: TieredLLM, prompt: list[int]) -> list[str]:
    """What anyone can compute: the block keys of a known prompt (no secret involved)."""
    rt = llm.runtime
    return [k for layer in block_keys_for_prompt(prompt, BLOCK_TOKENS, rt.fingerprint, rt.num_layers) for k in layer]


@pytest.fixture
def client(redis_server):
    import redis

    c = redis.Redis.from_url(redis_server.url)
    namespaces: list[str] = []
    yield c, namespaces
    for ns in namespaces:
        names = list(c.scan_iter(match=f"{ns}:*", count=1000))
        if names:
            c.delete(*names)
    c.close()


def fresh_namespace(namespaces: list[str]) -> str:
    namespaces.append(f"attack-{uuid.uuid4().hex[:10]}")
    return namespaces[-1]


def q_blocks_from_a_plain_run(redis_url, client, namespaces, prompt_q):
    """The attacker's material: the KV of text Q, from a run of their own against a plain tier."""
    ns = fresh_namespace(namespaces)
    llm = victim_llm(redis_url, ns, trusted=True)
    generate(llm, prompt_q)
    blocks = {}
    for key in public_keys(llm, prompt_q):
        value = client.get(f"{ns}:{key}")
        if value is not None:
            blocks[key] = decode_block(key, value)
    assert blocks, "the plain run stored no block of Q"
    return blocks


def forge_plain(client, namespace: str, victim_keys: list[str], q_keys: list[str], q_blocks: dict) -> int:
    """Q's KV written, codec and CRC valid, under the public keys of the victim's prompt."""
    num = 0
    for vk, qk in zip(victim_keys, q_keys):
        if qk in q_blocks:
            client.set(f"{namespace}:{vk}", encode_block_bytes(vk, q_blocks[qk]))
            num += 1
    return num


@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "aead"])
def test_forged_values_under_a_known_prompts_keys_do_not_change_its_tokens(redis_server, client, encrypt):
    client, namespaces = client
    gen = torch.Generator().manual_seed(7)
    prompt_p = torch.randint(0, 512, (128,), generator=gen).tolist()
    prompt_q = torch.randint(0, 512, (128,), generator=gen).tolist()
    _, reference = build("llama", seed=0)
    clean, _ = reference_greedy(reference, prompt_p, NEW_TOKENS)  # the run without tiers
    q_blocks = q_blocks_from_a_plain_run(redis_server.url, client, namespaces, prompt_q)
    probe = victim_llm(redis_server.url, "unused", trusted=True)
    p_keys, q_keys = public_keys(probe, prompt_p), public_keys(probe, prompt_q)
    layout = probe.runtime.layout
    probe.close()  # its Redis connection

    # control: a trusted (plain) tier takes the forged prefix and the victim's tokens change
    ns_plain = fresh_namespace(namespaces)
    assert forge_plain(client, ns_plain, p_keys, q_keys, q_blocks) > 0
    hijacked, _ = generate(victim_llm(redis_server.url, ns_plain, trusted=True), prompt_p)
    assert hijacked.stats["prefix_tokens"] > 0 and hijacked.token_ids != clean

    # sealed tier, forged values under the public keys: never found, tokens unchanged
    ns_sealed = fresh_namespace(namespaces)
    forge_plain(client, ns_sealed, p_keys, q_keys, q_blocks)
    assert not any(client.exists(f"{ns_sealed}:{sealed}") for sealed in
                   (BlockSealer(SECRET.encode(), layout, encrypt=encrypt).name(k) for k in p_keys))
    out, tier = generate(victim_llm(redis_server.url, ns_sealed, trusted=False, encrypt=encrypt), prompt_p)
    assert out.token_ids == clean and out.stats["prefix_tokens"] == 0

    # worst case: the attacker knows the victim's stored names (a legitimate run of P wrote them) and
    # overwrites them with genuine sealed blocks of Q and with Q's plain KV: each is a counted miss
    ns_known = fresh_namespace(namespaces)
    generate(victim_llm(redis_server.url, ns_known, trusted=False, encrypt=encrypt), prompt_q)
    generate(victim_llm(redis_server.url, ns_known, trusted=False, encrypt=encrypt), prompt_p)
    sealer = BlockSealer(SECRET.encode(), layout, encrypt=encrypt)
    num_forged = 0
    for i, (pk, qk) in enumerate(zip(p_keys, q_keys)):
        target, replay = f"{ns_known}:{sealer.name(pk)}", client.get(f"{ns_known}:{sealer.name(qk)}")
        if client.exists(target) and replay is not None:
            if i % 2:  # a genuine block of Q, replayed (codec frame re-keyed so only the seal can tell)
                block = decode_block(sealer.name(qk), replay)
                client.set(target, encode_block_bytes(sealer.name(pk), block))
            else:  # Q's plain KV, stuffed into a frame of the sealed size
                raw = torch.zeros(sealer.num_bytes, dtype=torch.uint8)
                plain = q_blocks[qk].reshape(-1).view(torch.uint8) if qk in q_blocks else raw[:0]
                raw[256 : 256 + plain.numel()] = plain
                client.set(target, encode_block_bytes(sealer.name(pk), raw.view(sealer.sealed_layout.shape)))
            num_forged += 1
    assert num_forged > 0
    out, tier = generate(victim_llm(redis_server.url, ns_known, trusted=False, encrypt=encrypt), prompt_p)
    assert out.token_ids == clean
    assert tier["auth_failures"] > 0 and tier["auth_failures"] <= num_forged
    assert tier["hits"] + tier["misses"] == tier["lookups"]


def test_stored_values_do_not_give_prompts_away_when_encrypted(redis_server, client):
    client, namespaces = client
    prompt = torch.randint(0, 512, (128,)).tolist()
    ns = fresh_namespace(namespaces)
    llm = victim_llm(redis_server.url, ns, trusted=False, encrypt=True)
    generate(llm, prompt)
    sealer = BlockSealer(SECRET.encode(), llm.runtime.layout, encrypt=True)
    names = list(client.scan_iter(match=f"{ns}:*"))
    assert names
    for name in names:  # no block's bytes (layer 0's V gives the tokens away) nor its key are readable
        value = client.get(name)
        key, block = sealer.open(None, decode_block(name.decode().split(":", 1)[1], value))
        assert key.encode() not in value
        assert bytes(block.reshape(-1).view(torch.uint8)[:64].numpy()) not in value
