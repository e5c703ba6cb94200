"""The Redis tier's read path (`RedisReads`, a part of `redis_tier.RedisTier`: it uses the tier's link, counters
and logs): each value read through STRLEN and GETRANGE, at most four blocks' bytes of it sent; decoded into one
fresh tensor per round trip; bad values (corrupt, another layout, another Redis type) counted and deleted by a
script only while unchanged since read, and a value far longer than a block counted and left for the next store.

Primitives: `RedisReads`, `is_wrong_type`.
"""
from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch

from tierkv.storage.codec import CorruptBlock, ForeignBlock, decode_block_into, header_num_bytes
from tierkv.storage.redis_link import KeyFailed


class RedisReads:
    """RedisTier's reading methods; the attributes they use are the tier's (`redis_tier.RedisTier.__init__`)."""

    def get_many(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        """Hits are rows of one fresh tensor per round trip, which the caller owns; None for a miss."""
        self._check_open()
        blocks: list[torch.Tensor | None] = [None] * len(keys)
        with self.counters.timed("get"):
            answered, corrupt, nil, wrong_type, foreign = [], [], [], [], []
            bad: list[tuple[str, bytes]] = []  # (key, value read) of corrupt and foreign ones
            for start in range(0, len(keys), self._batch_len):
                values = self._bounded_get(keys[start : start + self._batch_len])
                wrong_type += [i for i, v in enumerate(values, start) if is_wrong_type(v)]  # a cluster's GET
                self._count_key_errors(values)
                answered += [i for i, v in enumerate(values, start) if not isinstance(v, Exception)]
                nil += [i for i, v in enumerate(values, start) if v is None]
                oversized = [i for i, v in enumerate(values, start) if isinstance(v, _Oversized)]
                if oversized:  # counted, not deleted (only its first bytes were read: no digest to delete it by);
                    self._corrupt_log.note("%s: ignoring value(s) far longer than a block, e.g. %s (%d bytes)",
                                           self.name, self._redis_key(keys[oversized[0]]), values[oversized[0] - start].length)
                    corrupt += [keys[i] for i in oversized]  # not held (contains_many): the next store replaces it
                found = [(i, v) for i, v in enumerate(values, start) if isinstance(v, (bytes, bytearray))]
                for (i, value), row in zip(found, self.layout.empty(len(found)).unbind(0)):
                    try:
                        decode_block_into(keys[i], value, row)
                        blocks[i] = row
                    except ForeignBlock as exc:  # a block of another layout under this layout's address
                        self._corrupt_log.note("%s: dropping block(s) of another layout under this tier's keys (a "
                                               "writer of an older tierkv); latest: %s", self.name, exc)
                        foreign.append(keys[i])
                        bad.append((keys[i], value))
                    except CorruptBlock as exc:
                        self._corrupt_log.note("%s: dropping corrupt value(s); latest: %s", self.name, exc)
                        corrupt.append(keys[i])
                        bad.append((keys[i], value))
            if nil:  # a key of another Redis type answers WRONGTYPE; a TYPE call tells one stored since apart
                types = self._per_key("type", [keys[i] for i in nil])  # "string": stored since the read
                wrong_type += [i for i, t in zip(nil, types) if _type_name(t) not in ("", "none", "string")]
            if wrong_type:
                self._corrupt_log.note("%s: dropping key(s) that hold a value of another Redis type (not a block), "
                                       "e.g. %s", self.name, self._redis_key(keys[wrong_type[0]]))
            num_hits = sum(b is not None for b in blocks)
            self.counters.record_lookups(num_hits, len(keys) - num_hits, num_hits * self.layout.num_bytes)
            self._written.touch([keys[i] for i in answered if blocks[i] is not None])
            self._written.forget([keys[i] for i in answered if blocks[i] is None])
            if foreign:
                self.counters.add(foreign_records=len(foreign))
            if corrupt or wrong_type:
                self.counters.add(corrupt_blocks=len(corrupt) + len(wrong_type))
            if bad:
                self._drop_bad("drop_if_same", [k for k, _ in bad], [hashlib.sha1(v).hexdigest() for _, v in bad])
            if wrong_type:
                self._drop_bad("drop_if_not_string", [keys[i] for i in wrong_type])
        return blocks

    def _bounded_get(self, keys: Sequence[str]) -> list[Any]:
        """Each key's value (bytes), None where missing, _Oversized where far longer than a block's encoded value
        (a value planted at hundreds of MB was read whole into memory: only its first bytes are sent), or the
        error reply: one STRLEN and one GETRANGE per key."""
        names = [self._redis_key(k) for k in keys]
        # room for another layout's block too (read, named foreign and deleted), not for a planted giant
        limits = [4 * (header_num_bytes(k, len(self.layout.shape)) + self.layout.num_bytes) + (64 << 10) for k in keys]
        values = []
        for reply, limit in zip(self._link.per_key("bounded_get", names, limits), limits):
            if isinstance(reply, Exception) or reply is None:
                values.append(reply)
            elif not reply[0]:
                values.append(None)  # missing (or an empty string, which holds no block either)
            elif reply[0] > limit:
                values.append(_Oversized(reply[0]))
            else:
                values.append(bytes(reply[1]))
        return values

    def _drop_bad(self, command: str, keys: list[str], args: list[str] | None = None) -> None:
        """Delete bad values that are unchanged since read (a script); keys whose script failed (a server
        without scripting) are not held from now on, so the block is stored over them."""
        replies = self._per_key(command, keys, args, keep_errors=True)
        self._kept_bad.add(k for k, r in zip(keys, replies) if isinstance(r, Exception) and not isinstance(r, KeyFailed))


def _type_name(reply: Any) -> str:
    """TYPE's answer as text ("" for a call that failed)."""
    return reply.decode() if isinstance(reply, bytes) else reply if isinstance(reply, str) else ""


class _Oversized:
    """A value longer than any block's (`length` bytes), not read."""

    def __init__(self, length: int):
        self.length = length


def is_wrong_type(reply: Any) -> bool:
    """A WRONGTYPE error reply: the key holds a list, hash, ... where a block's string value belongs."""
    return isinstance(reply, Exception) and str(reply).startswith("WRONGTYPE")
