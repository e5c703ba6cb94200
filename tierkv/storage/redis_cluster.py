"""The Redis tier's link to a Redis Cluster (or Valkey cluster: the same protocol).

Primitives: `ClusterLink` (the interface of `redis_link.SingleLink`).

redis-py's `RedisCluster` keeps the slot map (which primary serves each of the 16384 hash
slots) and follows redirects; the batches go out here, one per node:

    names --keyslot--> slot --slot map--> node     grouped per node, then per node one call:
      get_many   pipeline of GET       set_many   framed SETs (redis_link.send_sets)
      per_key    pipeline of STRLEN+PTTL / TYPE / DEL, or of EVAL (the conditional deletes)
    a MOVED or ASK reply (a slot moved, or is moving): that key again through RedisCluster,
    which follows the redirect and patches its slot map

Health is per node (`redis_link.NodeHealth`): a node that fails is skipped for
retry_interval_s, so keys on it are misses and puts to it fail at once, while keys on the
other nodes are served. A node that fails makes the next batch ask RedisCluster for a fresh
slot map (after a failover a replica serves its slots). The tier is healthy while any
primary is. Before the first slot map is read (every startup node down) the whole cluster
counts as one node, "topology". Each call has one try, bounded by timeout_s.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from tierkv.storage.redis_link import KeyFailed, LinkBase, Unavailable, group_replies, import_redis, key_calls, send_sets
from tierkv.redact import redact_text
from tierkv.redis_url import ClusterUrl

TOPOLOGY = "topology"  # health of reaching any startup node, before a slot map exists


class ClusterLink(LinkBase):
    """Blocks spread over the primaries of the cluster that `address.startup_nodes` belong to."""

    def __init__(self, tier_name: str, address: ClusterUrl, timeout_s: float, retry_interval_s: float,
                 on_error: Callable[[], None]):
        redis = import_redis()
        super().__init__(tier_name, redis, retry_interval_s, on_error)
        from redis.cluster import RedisClusterException
        from redis.exceptions import AskError, MovedError

        self.address = address
        self._timeout_s = timeout_s
        self._redirects = (MovedError, AskError)
        self._setup_errors = (RedisClusterException, redis.exceptions.RedisError, OSError)
        self._cluster: Any = None
        self._refresh_after: str | None = None  # a node that failed again: re-read the slot map
        self._lock = threading.Lock()

    # -- the interface of SingleLink ------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        if self._cluster is None:
            return self.health.is_up(TOPOLOGY)
        return any(self.health.is_up(node.name) for node in self._cluster.get_primaries())

    def down_nodes(self) -> list[str]:
        return self.health.down_nodes()

    def ping(self) -> None:
        self._client()

    def get_many(self, names: Sequence[str]) -> list[Any]:
        return self._run(names, lambda client, sub: self._per_key_pipeline(client, "get", sub),
                         lambda cluster, i: cluster.execute_command("GET", names[i]))

    def per_key(self, command: str, names: Sequence[str], args: Sequence[Any] | None = None) -> list[Any]:
        index = {name: i for i, name in enumerate(names)}

        def send(client: Any, sub: list[str]) -> list[Any]:
            sub_args = None if args is None else [args[index[n]] for n in sub]
            return self._per_key_pipeline(client, command, sub, sub_args)

        def redirected(cluster: Any, i: int) -> Any:
            calls = key_calls(command, names[i], None if args is None else args[i])
            return group_replies(command, [cluster.execute_command(*call) for call in calls])[0]

        return self._run(names, send, redirected)

    def set_many(self, names: Sequence[str], values: Sequence[list], ttl_ms: int | None) -> list[Any]:
        index = {name: i for i, name in enumerate(names)}
        px = () if ttl_ms is None else ("PX", ttl_ms)

        def send(client: Any, sub: list[str]) -> list[Any]:
            return send_sets(client.connection_pool, sub, [values[index[n]] for n in sub], ttl_ms, self._response_error)

        def redirected(cluster: Any, i: int) -> Any:  # rare: joins the value into one copy
            return cluster.execute_command("SET", names[i], b"".join(values[i]), *px)

        return self._run(names, send, redirected)

    def close(self) -> None:
        with self._lock:
            cluster, self._cluster = self._cluster, None
        if cluster is not None:
            cluster.close()

    # -- batches per node ---------------------------------------------------------------------------
    def _run(self, names: Sequence[str], per_node: Callable[[Any, list[str]], list[Any]],
             redirected: Callable[[Any, int], Any]) -> list[Any]:
        cluster = self._client()
        if cluster is None:
            return [Unavailable(self.last_error)] * len(names)  # "topology: ...", as _mark_down names it
        self._refresh_if_asked(cluster)
        results: list[Any] = [None] * len(names)
        for node, indices in self._by_node(cluster, names, results).items():
            sub = [names[i] for i in indices]
            client = cluster.get_redis_connection(node)
            replies = self._call_node(node.name, len(sub), lambda: per_node(client, sub))
            for i, reply in zip(indices, replies):
                results[i] = self._follow(cluster, i, reply, redirected) if isinstance(reply, self._redirects) else reply
        return results

    def _by_node(self, cluster: Any, names: Sequence[str], results: list[Any]) -> dict[Any, list[int]]:
        """Indices of `names` per primary; a key whose slot no node serves gets a counted KeyFailed."""
        groups: dict[str, tuple[Any, list[int]]] = {}
        uncovered = 0
        for i, name in enumerate(names):
            try:
                node = cluster.nodes_manager.get_node_from_slot(cluster.keyslot(name))
            except self._setup_errors as exc:  # SlotNotCoveredError
                results[i] = KeyFailed(f"slot of {name}: {exc}")
                uncovered += 1
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        if uncovered:
            self._on_error()
            self._refresh_after = TOPOLOGY
        return {node: indices for node, indices in groups.values()}

    def _follow(self, cluster: Any, i: int, redirect: Any, redirected: Callable[[Any, int], Any]) -> Any:
        """One key again through RedisCluster, which follows MOVED and ASK; failures counted. The node redirected
        to is marked down when it does not answer, so the batch's other keys sent there are skipped, not each
        waited for (a slot migrating to a stopped node)."""
        target = f"{redirect.host}:{redirect.port}"
        if not self.health.is_up(target):
            self._on_error()
            return Unavailable(f"{target} is down: {self.last_error}")
        try:
            return redirected(cluster, i)
        except self._link_errors as exc:
            self._mark_down(target, exc)
            return Unavailable(self.last_error)
        except self._response_error as exc:
            if str(exc).startswith("WRONGTYPE") and not isinstance(exc, self._redirects):
                return exc  # the key's own reply (another Redis type), as a pipeline hands it back
            return self._failed_follow(exc)
        except self._setup_errors as exc:
            return self._failed_follow(exc)

    def _failed_follow(self, exc: BaseException) -> KeyFailed:
        self.last_error = redact_text(f"{type(exc).__name__}: {exc}")
        self._on_error()
        return KeyFailed(f"redirected: {self.last_error}")

    # -- the slot map -----------------------------------------------------------------------------
    def _client(self) -> Any:
        """The RedisCluster, made on first use; None (counted) while no startup node answers."""
        with self._lock:
            if self._cluster is not None:
                return self._cluster
        if not self.health.is_up(TOPOLOGY):
            self._on_error()
            return None
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.retry import Retry

        address = self.address
        try:
            cluster = RedisCluster(
                startup_nodes=[ClusterNode(host, port) for host, port in address.startup_nodes],
                retry=Retry(NoBackoff(), 0), require_full_coverage=False, ssl=address.is_tls,
                username=address.username, password=address.password,
                socket_timeout=self._timeout_s, socket_connect_timeout=self._timeout_s,
            )
        except self._setup_errors as exc:
            self._mark_down(TOPOLOGY, exc)
            return None
        self.health.mark_up(TOPOLOGY)
        with self._lock:
            if self._cluster is None:
                self._cluster = cluster
                return cluster
        cluster.close()  # another thread made one first
        return self._cluster

    def _mark_down(self, node: str, exc: BaseException) -> None:
        super()._mark_down(node, exc)
        if node != TOPOLOGY:
            self._refresh_after = node  # the next batch re-reads the slot map first

    def _refresh_if_asked(self, cluster: Any) -> None:
        failed, self._refresh_after = self._refresh_after, None
        if failed is None:
            return
        try:
            cluster.nodes_manager.initialize(last_failed_node_name=None if failed == TOPOLOGY else failed)
        except self._setup_errors as exc:
            self.last_error = redact_text(f"slot map refresh: {type(exc).__name__}: {exc}")
            self._on_error()
