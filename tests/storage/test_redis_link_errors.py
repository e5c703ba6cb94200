"""A Redis link's last error names the node that failed, whatever redis-py's message says (a refused
connection names the address, a broken pipe or a timeout does not), with credentials redacted, and
each key of the batch gets that error."""
from __future__ import annotations

import pytest
redis = pytest.importorskip("redis", reason="the Redis tier needs redis-py (installed by .ci/run)")

from tierkv.storage.redis_link import KeyFailed, LinkBase, Unavailable


@pytest.mark.parametrize("exc, kind", [
    (redis.exceptions.ConnectionError("Error 32 while writing to socket. Broken pipe."), Unavailable),
    (redis.exceptions.TimeoutError("Timeout reading from socket"), Unavailable),
    (OSError("Connection reset by peer"), Unavailable),
    (redis.exceptions.ResponseError("OOM command not allowed"), KeyFailed),
])
def test_the_last_error_names_the_failed_node(exc, kind):
    errors = []
    link = LinkBase("redis", redis, retry_interval_s=5.0, on_error=lambda: errors.append(1))

    def failing():
        raise exc

    node = "redis://:Sup3rSecretPw@10.0.0.7:7001"
    replies = link._call_node(node, 3, failing)
    assert len(replies) == 3 and all(type(r) is kind for r in replies) and errors == [1]
    assert "10.0.0.7:7001" in link.last_error and str(exc) in link.last_error
    assert "Sup3rSecretPw" not in link.last_error and all("Sup3rSecretPw" not in str(r) for r in replies)
