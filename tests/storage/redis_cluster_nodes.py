"""A real Redis Cluster for tests: `num_nodes` redis-server masters on loopback, no replicas.

`RedisClusterNodes.start()` starts each node with `--cluster-enabled yes` and its own cluster
config file in its own directory, joins them with `redis-cli --cluster create`, and waits
until every node says `cluster_state:ok` and sees all 16384 slots assigned. Nodes run with
`cluster-require-full-coverage no`, as docs/tiers.md asks of a cluster used as a cache: the
live nodes keep serving their slots while one is down.

Failures to inject: `kill(i)` (SIGKILL, as a crash), `freeze(i)` / `thaw(i)` (SIGSTOP /
SIGCONT: a node that accepts connections but never answers), `restart(i)` (same port and
cluster config file, so it rejoins with its slots; its data is gone: no persistence),
`move_slots(slots, src, dst)` (CLUSTER SETSLOT ... IMPORTING/MIGRATING, MIGRATE, NODE).
"""
from __future__ import annotations

import random
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.storage.conftest import RedisServer, answers_ping

_READY_DEADLINE_S = 20.0


def free_cluster_port() -> int:
    """A loopback port P with P + 10000 (the cluster bus) free too; P <= 55535, as Redis requires."""
    for _ in range(200):
        port = random.randint(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


class ClusterNode(RedisServer):
    """One cluster-enabled redis-server; its cluster config file survives restarts."""

    def __init__(self, executable: str, workdir: Path, node_timeout_ms: int):
        super().__init__(executable, workdir)
        self.port = free_cluster_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.extra_args = [
            "--cluster-enabled", "yes", "--cluster-config-file", str(workdir / "nodes.conf"),
            "--cluster-node-timeout", str(node_timeout_ms), "--cluster-require-full-coverage", "no",
        ]  # fmt: skip

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def freeze(self) -> None:
        self._proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self._proc.send_signal(signal.SIGCONT)

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None


class RedisClusterNodes:
    """`num_nodes` masters covering all slots; `url` is the tier's redis+cluster:// URL."""

    def __init__(self, server: str, cli: str, workdir: Path, num_nodes: int = 3, node_timeout_ms: int = 2000):
        self.cli = cli
        self.nodes: list[ClusterNode] = []
        for i in range(num_nodes):
            (workdir / f"node{i}").mkdir(parents=True, exist_ok=True)
            self.nodes.append(ClusterNode(server, workdir / f"node{i}", node_timeout_ms))

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(node.address for node in self.nodes)

    def start(self) -> None:
        """Start the nodes and join them; on any failure every node started is stopped again."""
        try:
            for node in self.nodes:
                node.start()
            created = subprocess.run(
                [self.cli, "--cluster", "create", *(n.address for n in self.nodes), "--cluster-replicas", "0",
                 "--cluster-yes"], capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            if created.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout[-2000:]} {created.stderr[-2000:]}")
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def client(self, i: int):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.nodes[i].port, socket_timeout=2)

    def wait_ready(self) -> None:
        """Until every node answers, says cluster_state:ok, and sees every slot of a live master."""
        deadline = time.monotonic() + _READY_DEADLINE_S
        while not all(self._node_ready(i) for i in range(len(self.nodes))):
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ready within {_READY_DEADLINE_S}s: {self._states()}")
            time.sleep(0.05)

    def _node_ready(self, i: int) -> bool:
        if not answers_ping(self.nodes[i].port):
            return False
        with self.client(i) as client:
            info = client.execute_command("CLUSTER", "INFO")
            info = info.decode() if isinstance(info, bytes) else info
            nodes = client.execute_command("CLUSTER", "NODES")
        if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
            return False
        text = nodes if isinstance(nodes, str) else str(nodes)
        return "fail" not in text and "handshake" not in text and "noaddr" not in text

    def _states(self) -> list[str]:
        states = []
        for i, node in enumerate(self.nodes):
            try:
                with self.client(i) as client:
                    states.append(str(client.execute_command("CLUSTER", "INFO"))[:200])
            except Exception as exc:  # a report of why the cluster is not ready
                states.append(f"{node.address}: {exc}")
        return states

    def kill(self, i: int) -> None:
        self.nodes[i].kill()

    def freeze(self, i: int) -> None:
        self.nodes[i].freeze()

    def thaw(self, i: int) -> None:
        self.nodes[i].thaw()

    def restart(self, i: int) -> None:
        """Start node i again on its port with its cluster config file; wait for the cluster to be ok."""
        self.nodes[i].kill()
        self.nodes[i].stop()
        self.nodes[i].start()
        self.wait_ready()

    def ensure_healthy(self) -> None:
        for i, node in enumerate(self.nodes):
            if node.is_alive():
                node.thaw()
            else:
                self.restart(i)
        self.wait_ready()

    def node_id(self, i: int) -> str:
        with self.client(i) as client:
            return client.execute_command("CLUSTER", "MYID").decode()

    def owners(self) -> list[int]:
        """Index of the node that serves each of the 16384 slots, as a live node sees it."""
        owner = [-1] * 16384
        i = next(i for i, node in enumerate(self.nodes) if node.is_alive())
        with self.client(i) as client:
            for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                index = next(j for j, n in enumerate(self.nodes) if n.port == int(master[1]))
                owner[start : end + 1] = [index] * (end - start + 1)
        return owner

    def node_of(self, name: str) -> int:
        """Index of the node that serves the Redis key `name`."""
        from redis.crc import key_slot

        return self.owners()[key_slot(name.encode())]

    def move_slots(self, slots: list[int], src: int, dst: int, before_migrate=None) -> None:
        """Move each slot's keys from node src to node dst, the way redis-cli --cluster reshard does.

        `before_migrate(slot)` runs while the slot is MIGRATING/IMPORTING and no key has moved yet
        (clients get ASK redirects for keys that are not on src)."""
        src_id, dst_id = self.node_id(src), self.node_id(dst)
        with self.client(src) as source, self.client(dst) as target:
            for slot in slots:
                target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
                source.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
                if before_migrate is not None:
                    before_migrate(slot)
                while keys := source.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                    source.execute_command("MIGRATE", "127.0.0.1", self.nodes[dst].port, "", 0, 5000, "KEYS", *keys)
                for client in (target, source):
                    client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        for i, node in enumerate(self.nodes):
            if i not in (src, dst) and node.is_alive():
                with self.client(i) as other:
                    for slot in slots:
                        other.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)

    def stop(self) -> None:
        for node in self.nodes:
            if node.is_alive():
                node.thaw()
            node.stop()
