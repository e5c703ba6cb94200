"""Content addressing: shared prefixes share keys; other models, dtypes and layers never do."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.blocks import BlockLayout, block_keys_for_prompt, chain_block_hashes, model_fingerprint
from tierkv.storage.codec import CorruptBlock, decode_block, encode_block_bytes

LAYOUT = BlockLayout(num_kv_heads=8, block_tokens=16, head_dim=128, dtype=torch.bfloat16)


def test_layout_bytes_match_llama_8b_block():
    assert LAYOUT.num_bytes == 64 * 1024  # 2 x 8 heads x 16 tokens x 128 dims x 2 bytes
    assert LAYOUT.shape == (2, 8, 16, 128)


def test_shared_prefix_shares_block_hashes_and_diverges_after():
    fp = model_fingerprint("m", 32, LAYOUT)
    prefix = [random.randrange(50_000) for _ in range(64)]
    a = chain_block_hashes(prefix + [1, 2, 3] * 10, 16, fp)
    b = chain_block_hashes(prefix + [4, 5, 6] * 10, 16, fp)
    assert a[:4] == b[:4]
    assert all(x != y for x, y in zip(a[4:], b[4:]))
    # A change in the first block changes every later hash (the chain).
    c = chain_block_hashes([prefix[0] + 1] + prefix[1:], 16, fp)
    assert all(x != y for x, y in zip(a[:4], c))


def test_partial_last_block_has_its_own_hash():
    fp = model_fingerprint("m", 32, LAYOUT)
    hashes = chain_block_hashes(list(range(40)), 16, fp)
    assert len(hashes) == 3
    assert chain_block_hashes(list(range(41)), 16, fp)[2] != hashes[2]


def test_model_dtype_and_layer_separate_keys():
    tokens = list(range(32))
    fp_a = model_fingerprint("llama", 32, LAYOUT)
    fp_b = model_fingerprint("qwen", 32, LAYOUT)
    fp_c = model_fingerprint("llama", 32, BlockLayout(8, 16, 128, torch.float16))
    keys = [block_keys_for_prompt(tokens, 16, fp, num_layers=2) for fp in (fp_a, fp_b, fp_c)]
    flat = [k for per_model in keys for layer in per_model for k in layer]
    assert len(flat) == len(set(flat)) == 3 * 2 * 2


def test_bad_token_ids_are_rejected():
    with pytest.raises(ValueError, match="block_tokens"):
        chain_block_hashes([1, 2], 0, "fp")
    with pytest.raises(ValueError, match="flat"):
        chain_block_hashes([[1, 2]], 16, "fp")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_codec_round_trip_and_corruption(dtype):
    block = torch.randn(2, 2, 4, 8).to(dtype)
    data = bytearray(encode_block_bytes("k/L0", block))
    assert torch.equal(decode_block("k/L0", data).view(torch.uint8), block.view(torch.uint8))
    with pytest.raises(CorruptBlock, match="another key"):
        decode_block("other/L0", data)
    flipped = bytearray(data)
    flipped[-1] ^= 0x40
    with pytest.raises(CorruptBlock, match="checksum"):
        decode_block("k/L0", flipped)
    with pytest.raises(CorruptBlock):
        decode_block("k/L0", data[:-3])
    with pytest.raises(CorruptBlock):
        decode_block("k/L0", data[:5])
    shape_flip = bytearray(data)
    shape_flip[8] ^= 0x01  # first shape dim
    with pytest.raises(CorruptBlock):
        decode_block("k/L0", shape_flip)


def test_extending_a_chain_equals_hashing_it_whole():
    fp = model_fingerprint("m", 2, LAYOUT)
    tokens = [random.randrange(1000) for _ in range(16 * 7)]
    whole = chain_block_hashes(tokens, 16, fp)
    head = chain_block_hashes(tokens[: 16 * 3], 16, fp)
    assert head + chain_block_hashes(tokens[16 * 3 :], 16, fp, parent_hash=head[-1]) == whole


def test_decode_into_checks_shape_dtype_and_checksum():
    from tierkv.storage.codec import decode_block_into

    block = torch.randn(2, 2, 4, 8).to(torch.bfloat16)
    data = bytearray(encode_block_bytes("k/L0", block))
    out = torch.empty_like(block)
    decode_block_into("k/L0", data, out)
    assert torch.equal(out.view(torch.uint8), block.view(torch.uint8))
    with pytest.raises(CorruptBlock, match="expected"):
        decode_block_into("k/L0", data, torch.empty(2, 2, 4, 8, dtype=torch.float16))
    data[-1] ^= 1
    with pytest.raises(CorruptBlock, match="checksum"):
        decode_block_into("k/L0", data, out)


def test_block_keys_are_block_key_for_each_hash():
    """The batched key builder the tiers' lookups use names blocks exactly as `block_key` does."""
    from tierkv.blocks import block_key, block_keys

    hashes = chain_block_hashes(list(range(64)), 16, "fp")
    assert block_keys(hashes, 3) == [block_key(h, 3) for h in hashes]
    assert block_keys(hashes, 0, "/R1of2") == [block_key(h, 0) + "/R1of2" for h in hashes]
    assert len(set(block_keys(hashes, 1)) | set(block_keys(hashes, 2))) == 2 * len(hashes)


def _spec_hashes(ids: list[int], block_tokens: int, fingerprint: str, parent_hash: str | None) -> list[str]:
    """The block hash as stored blocks were keyed since the first build: sha256(parent digest + the
    block's ids as little-endian int64), the first parent sha256(fingerprint)."""
    import hashlib
    import struct
    parent = bytes.fromhex(parent_hash) if parent_hash else hashlib.sha256(fingerprint.encode()).digest()
    out = []
    for start in range(0, len(ids), block_tokens):
        chunk = ids[start : start + block_tokens]
        parent = hashlib.sha256(parent + struct.pack(f"<{len(chunk)}q", *chunk)).digest()
        out.append(parent.hex())
    return out


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=200),
       block_tokens=st.integers(min_value=1, max_value=70), parent=st.none() | st.binary(min_size=32, max_size=32))
def test_block_hashes_keep_their_format_for_every_input_kind(ids, block_tokens, parent):
    """Keys of blocks already on disk or in Redis stay valid: a list, a numpy array and a tensor of the
    same ids hash as the format says, whole or extended block by block from a parent."""
    import numpy as np
    parent_hash = parent.hex() if parent is not None else None
    want = _spec_hashes(ids, block_tokens, "fp", parent_hash)
    assert chain_block_hashes(ids, block_tokens, "fp", parent_hash) == want
    assert chain_block_hashes(np.array(ids, dtype=np.int64), block_tokens, "fp", parent_hash) == want
    assert chain_block_hashes(torch.tensor(ids, dtype=torch.int64), block_tokens, "fp", parent_hash) == want
    assert chain_block_hashes(tuple(ids), block_tokens, "fp", parent_hash) == want
