"""``TWOPHASE_KAFKA_EXTRA_LISTENERS``: a listener that advertises a proxy's port keeps every
connection of a client that bootstrapped through that proxy going through it (the hook the
Toxiproxy faults build on), and a malformed value stops stack.sh before anything starts.

Runs its own one-broker Kafka (``stack.sh start kafka`` in a private stack dir, ports 4139x),
so it needs no running stack and leaves the shared one alone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

pytestmark = pytest.mark.stack

STACK_SH = Path(__file__).resolve().parents[2] / "stack" / "stack.sh"
#: Below Linux's ephemeral range (32768-60999): an outgoing connection never holds them.
KAFKA_PORT = 28392
CONTROLLER_PORT = 28393
#: The extra listener's own port, and the port it advertises (where the proxy listens).
LISTEN_PORT = 28394
PROXY_PORT = 28395
#: A JVM start on the shared 2-core machine has taken over a minute under load.
START_TIMEOUT_S = 300
CALL_TIMEOUT_S = 30


def _stack(stack_dir: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "TWOPHASE_STACK_DIR": str(stack_dir),
        "TWOPHASE_KAFKA_PORT": str(KAFKA_PORT),
        "TWOPHASE_KAFKA_CONTROLLER_PORT": str(CONTROLLER_PORT),
        "TWOPHASE_KAFKA_HEAP": "256m",
        "TWOPHASE_KAFKA_BROKERS": "1",
    }
    env.pop("TWOPHASE_KAFKA_EXTRA_LISTENERS", None)
    env.update(extra)
    return subprocess.run(
        ["bash", str(STACK_SH), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def proxied_kafka() -> Iterator[Path]:
    stack_dir = Path(tempfile.mkdtemp(prefix="twophase-listeners-"))
    extra = {"TWOPHASE_KAFKA_EXTRA_LISTENERS": f"P0:{LISTEN_PORT}:{PROXY_PORT}"}
    try:
        started = _stack(stack_dir, "start", "kafka", **extra)
        assert started.returncode == 0, started.stderr
        yield stack_dir
    finally:
        _stack(stack_dir, "down")
        shutil.rmtree(stack_dir, ignore_errors=True)


class Forwarder:
    """A TCP proxy 127.0.0.1:listen -> 127.0.0.1:target that counts its connections."""

    def __init__(self, listen: int, target: int) -> None:
        self.target = target
        self.connections = 0
        self._server = socket.create_server(("127.0.0.1", listen))
        self._open: list[socket.socket] = [self._server]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.connections += 1
            self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for s in self._open:
            with contextlib.suppress(OSError):
                s.close()


def _advertised(bootstrap: str) -> dict[int, str]:
    meta = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=CALL_TIMEOUT_S)
    return {b.id: f"{b.host}:{b.port}" for b in meta.brokers.values()}


def test_metadata_names_the_address_each_listener_advertises(proxied_kafka: Path) -> None:
    # Asked on the extra listener's own port, the broker names the proxy's port...
    assert _advertised(f"127.0.0.1:{LISTEN_PORT}") == {1: f"127.0.0.1:{PROXY_PORT}"}
    # ...while the stack's own listener is unchanged.
    assert _advertised(f"127.0.0.1:{KAFKA_PORT}") == {1: f"127.0.0.1:{KAFKA_PORT}"}
    env = (proxied_kafka / "stack.env").read_text()
    assert f"TWOPHASE_KAFKA_BOOTSTRAP='127.0.0.1:{KAFKA_PORT}'" in env
    assert f"TWOPHASE_KAFKA_EXTRA_LISTENERS='P0:{LISTEN_PORT}:{PROXY_PORT}'" in env


def test_a_client_bootstrapped_through_the_proxy_stays_on_it(proxied_kafka: Path) -> None:
    topic = f"t_{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{KAFKA_PORT}"})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(CALL_TIMEOUT_S)
    proxy = Forwarder(PROXY_PORT, LISTEN_PORT)
    try:
        via_proxy = f"127.0.0.1:{PROXY_PORT}"
        producer = Producer({"bootstrap.servers": via_proxy, "acks": "all"})
        producer.produce(topic, b"through the proxy")
        assert producer.flush(CALL_TIMEOUT_S) == 0
        consumer = Consumer({"bootstrap.servers": via_proxy, "group.id": topic})
        try:
            consumer.assign([TopicPartition(topic, 0, 0)])
            got = None
            for _ in range(CALL_TIMEOUT_S):
                got = consumer.poll(1)
                if got is not None and got.error() is None:
                    break
            assert got is not None and got.value() == b"through the proxy"
        finally:
            consumer.close()
        # Bootstrap plus the broker connection of each client (the consumer's group
        # coordinator too): had the broker advertised its own port, only the bootstraps
        # would have passed the proxy and the broker connections would have gone around it.
        assert proxy.connections >= 4, proxy.connections
    finally:
        proxy.close()


@pytest.mark.parametrize(
    "value",
    ["P0:28394", "p0:28394:28395", "P0:28394:28395,", "CONTROLLER:28394:28395", "P0:99999:1"],
)
def test_a_malformed_value_stops_stack_sh_naming_the_variable(value: str) -> None:
    stack_dir = Path(tempfile.mkdtemp(prefix="twophase-listeners-bad-"))
    try:
        result = _stack(stack_dir, "start", "kafka", TWOPHASE_KAFKA_EXTRA_LISTENERS=value)
        assert result.returncode != 0
        assert f"TWOPHASE_KAFKA_EXTRA_LISTENERS={value}:" in result.stderr, result.stderr
        assert not list((stack_dir / "run").glob("*.pid")), "something was started"
    finally:
        shutil.rmtree(stack_dir, ignore_errors=True)


@pytest.mark.parametrize(
    ("value", "clash"),
    [
        # Node 2 listens at 28394 + 100 = 28494: node 1's advertised port.
        ("P0:28394:28494", "port 28494"),
        # P1's listen port is where P0's lands on node 2.
        ("P0:28394:28395,P1:28494:28396", "port 28494"),
        # Node 2's own Kafka port (28392 + 100).
        ("P0:28492:28395", "port 28492"),
    ],
)
def test_three_brokers_refuse_listeners_whose_node_ports_clash(
    tmp_path: Path, value: str, clash: str
) -> None:
    # Node N has every listener at both ports + 100*(N-1): a value whose shifted ports land on
    # another node's is refused before anything starts.
    result = _stack(
        tmp_path,
        "start",
        "kafka",
        TWOPHASE_KAFKA_BROKERS="3",
        TWOPHASE_KAFKA_EXTRA_LISTENERS=value,
    )
    assert result.returncode != 0
    assert f"TWOPHASE_KAFKA_EXTRA_LISTENERS={value}: {clash} would be both" in result.stderr, (
        result.stderr
    )
    assert not list((tmp_path / "run").glob("*.pid")), "something was started"
