"""A pipeline on a three-broker Kafka keeps committing, with no operator action, while the
broker that matters is SIGKILLed: first the leader of the control topic's partition (where the
decisions are written), which the test makes the source group's coordinator too (where the
commit decisions move the group's offsets), then the broker holding the coordinator's
transaction state (its transaction coordinator). It ends exact: every record once in PostgreSQL, nothing prepared.

The test runs its own stack (``TWOPHASE_KAFKA_BROKERS=3 stack.sh start kafka pg`` in a private
stack dir, ports 28092/28192/28292, controllers +1, PostgreSQL 28432: below Linux's ephemeral
range, 32768-60999, where a client's outgoing port once took one of them), so the shared stack is
neither needed nor touched. Three nodes tolerate one down at a time: the first killed node is
started again, and back in every in-sync replica set, before the second kill.

With replication factor 1 (or the broker defaults of a one-node stack) the first kill leaves
the control partition without a leader and commits stop: the resume bound fails.

The stack also has an extra listener (``TWOPHASE_KAFKA_EXTRA_LISTENERS``, on every node at the
node's stride), which the chaos run's per-process Kafka proxies need on three brokers too: a
client that bootstraps through its Toxiproxy proxy to node 1 is given every node's proxy, and
when its proxies are cut it reaches no broker at all.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from harness import Cluster, Scenario, end_offsets, group_offsets, produce, wait_until
from harness.kafka_nodes import (
    TRANSACTION_STATE_TOPIC,
    group_coordinator_of,
    leader_of,
    txn_coordinator_of,
)
from harness.toxiproxy import ToxiproxyServer
from tests.conftest import read_stack_env
from tests.e2e.e2e_support import caught_up, settle, start
from twophase.config import PipelineConfig, load_config
from twophase.kafka import create_topics

pytestmark = pytest.mark.stack

STACK_SH = Path(__file__).resolve().parents[2] / "stack" / "stack.sh"
#: Every topic of the pipeline: one broker down leaves two in-sync replicas (the stack's
#: min.insync.replicas), so acks=all writes go on.
REPLICATION_FACTOR = 3
#: Starting three JVMs (or one again) on the shared 2-core machine has taken over a minute.
STACK_TIMEOUT_S = 300
#: Commits must have caught up with what was produced after a kill within this: the cluster
#: fences the dead node after broker.session.timeout.ms (9 s) and elects new leaders, the
#: clients find them, a cycle in flight may time out on its vote (10 s) and is retried.
RESUME_BOUND_S = 90.0
#: The restarted node catches up a few MB of replicas.
ISR_TIMEOUT_S = 120.0
BATCH = 1000
#: Pipeline names drawn to find one whose group coordinator and control leader share a node.
PLACEMENT_TRIES = 30
#: The extra listener of node 1 and the port it advertises (node N: + 100*(N-1), as the
#: nodes' own ports), and the Toxiproxy API's port.
LISTEN_PORT, PROXY_PORT, TOXIPROXY_PORT = 28060, 28070, 28050
NODE_STRIDE = 100
#: A write's delivery bound in the proxy test: short, since the cut one must time out.
SEND_TIMEOUT_MS = 10_000


def _stack_env(stack_dir: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "TWOPHASE_STACK_DIR": str(stack_dir),
        "TWOPHASE_KAFKA_BROKERS": "3",
        "TWOPHASE_KAFKA_PORT": "28092",
        "TWOPHASE_KAFKA_CONTROLLER_PORT": "28093",
        "TWOPHASE_PG_PORT": "28432",
        "TWOPHASE_KAFKA_HEAP": "384m",
        "TWOPHASE_KAFKA_EXTRA_LISTENERS": f"T0:{LISTEN_PORT}:{PROXY_PORT}",
    }
    return env


def _stack(stack_dir: Path, *args: str) -> None:
    result = subprocess.run(
        ["bash", str(STACK_SH), *args],
        env=_stack_env(stack_dir),
        capture_output=True,
        text=True,
        timeout=STACK_TIMEOUT_S,
    )
    assert result.returncode == 0, f"stack.sh {' '.join(args)}: {result.stderr}"


@pytest.fixture(scope="module")
def three_brokers() -> Iterator[dict[str, str]]:
    # Not pytest's tmp_path: PostgreSQL runs as the postgres OS user, which needs o+x on
    # every parent directory, and pytest's are 0700.
    stack_dir = Path(tempfile.mkdtemp(prefix="twophase-3b-"))
    stack_dir.chmod(0o755)
    try:
        _stack(stack_dir, "start", "kafka", "pg")
        yield read_stack_env(stack_dir / "stack.env")
    finally:
        # A throwaway stack: SIGKILL the nodes rather than wait for controlled shutdowns.
        for command in ("kill-broker 1", "kill-broker 2", "kill-broker 3", "down"):
            subprocess.run(
                ["bash", str(STACK_SH), *command.split()],
                env=_stack_env(stack_dir),
                capture_output=True,
                timeout=STACK_TIMEOUT_S,
            )
        shutil.rmtree(stack_dir, ignore_errors=True)


def _full_isr(bootstrap: str, topics: list[str]) -> bool:
    meta = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10)
    for topic in topics:
        tm = meta.topics.get(topic)
        if tm is None or tm.error is not None:
            return False
        if any(len(p.isrs) < REPLICATION_FACTOR for p in tm.partitions.values()):
            return False
    return True


def _pipeline_with_one_node_holding_both(
    stack: dict[str, str], tmp_path: Path
) -> tuple[Scenario, PipelineConfig]:
    """A pipeline (topics created) whose source group is coordinated by the node that leads
    its control partition: killing that node moves both at once, as in a CI run where the
    leader then froze. Names are drawn until the placement fits (one in three does)."""
    bootstrap = stack["TWOPHASE_KAFKA_BOOTSTRAP"]
    for _ in range(PLACEMENT_TRIES):
        s = Scenario(
            name=f"tb-{uuid.uuid4().hex[:6]}",
            bootstrap=bootstrap,
            pg_dsn=stack["TWOPHASE_PG_DSN"],
            mongo_uri="",
            workdir=tmp_path,
            partitions=2,
            interval_ms=300,
            mongo=False,
            files=False,
        )
        s.extra = {
            "control": {"hmac_key": s.hmac_key, "replication_factor": REPLICATION_FACTOR},
            "sources": [
                {
                    "topic": s.topic,
                    "partitions": s.partitions,
                    "replication_factor": REPLICATION_FACTOR,
                }
            ],
            "dead_letter": {"replication_factor": REPLICATION_FACTOR},
        }
        s.write()
        cfg = load_config(s.config_path)
        create_topics(cfg)
        if _one_node_holds_both(bootstrap, s.topic, cfg):
            s.prepare_stores()
            return s, cfg
    raise AssertionError(f"no pipeline name in {PLACEMENT_TRIES} put both on one node")


def _one_node_holds_both(bootstrap: str, topic: str, cfg: PipelineConfig) -> bool:
    """Whether the node coordinating ``cfg``'s source group leads its control partition."""
    # Kafka creates its group state topic on the first coordinator lookup.
    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": cfg.group_id})
    try:
        wait_until(
            _quietly(lambda: probe.committed([TopicPartition(topic, 0)], 10) is not None),
            60,
            "the group's coordinator",
        )
    finally:
        probe.close()
    return _quietly(
        lambda: (
            group_coordinator_of(bootstrap, cfg.group_id)
            == leader_of(bootstrap, cfg.control_topic, 0)
        )
    )()


def _quietly(pred: Callable[[], bool]) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            return pred()
        except (KafkaException, LookupError):  # a request met the dead node: ask again
            return False

    return probe


def test_a_client_through_its_proxies_reaches_every_node_only_through_them(
    three_brokers: dict[str, str], tmp_path: Path
) -> None:
    topic = f"t_{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": three_brokers["TWOPHASE_KAFKA_BOOTSTRAP"]})
    # Three partitions, replicated: each node leads one, so a client writes to every node.
    admin.create_topics([NewTopic(topic, 3, REPLICATION_FACTOR)])[topic].result(60)
    server = ToxiproxyServer(TOXIPROXY_PORT, tmp_path / "toxiproxy")
    api = server.start()
    names = [f"node-{n}" for n in (1, 2, 3)]
    try:
        for i, name in enumerate(names):
            plus = NODE_STRIDE * i
            api.create(name, f"127.0.0.1:{PROXY_PORT + plus}", f"127.0.0.1:{LISTEN_PORT + plus}")
        via = f"127.0.0.1:{PROXY_PORT}"
        meta = AdminClient({"bootstrap.servers": via}).list_topics(timeout=30)
        assert {b.id: f"{b.host}:{b.port}" for b in meta.brokers.values()} == {
            n: f"127.0.0.1:{PROXY_PORT + NODE_STRIDE * (n - 1)}" for n in (1, 2, 3)
        }
        assert {p.leader for p in meta.topics[topic].partitions.values()} == {1, 2, 3}

        # One client, bootstrapped through the proxy to node 1, connected to every node.
        errors: list[str] = []
        producer = Producer(
            {
                "bootstrap.servers": via,
                "acks": "all",
                "message.timeout.ms": SEND_TIMEOUT_MS,
                # After the cut below its reconnect backoff has grown toward librdkafka's 10 s
                # default maximum, which alone could outlast a send's timeout after the heal.
                "reconnect.backoff.max.ms": 1000,
            }
        )

        def send() -> list[str]:
            """One record to each partition (each node leads one): the delivery errors."""
            errors.clear()
            for partition in range(3):
                producer.produce(
                    topic,
                    b"x",
                    partition=partition,
                    on_delivery=lambda e, _m: e is None or errors.append(str(e)),
                )
            assert producer.flush(SEND_TIMEOUT_MS / 1000 + 30) == 0
            return list(errors)

        assert send() == []
        # Cut its links: had any of its connections gone around the proxies, to whichever
        # node leads a partition, that write would still land.
        for name in names:
            api.set_enabled(name, False)
        assert len(send()) == 3, errors
        for name in names:
            api.heal(name)
        # Healed, it reaches every node again: a send may time out while its links come back
        # (CI saw one record do so), so the first clean send within a minute is the proof.
        deadline = time.monotonic() + 60
        while (after_heal := send()) and time.monotonic() < deadline:
            pass
        assert after_heal == []
    finally:
        server.stop()


def test_commits_go_on_while_the_brokers_that_matter_are_killed(
    three_brokers: dict[str, str], tmp_path: Path
) -> None:
    bootstrap = three_brokers["TWOPHASE_KAFKA_BOOTSTRAP"]
    assert len(bootstrap.split(",")) == 3, bootstrap
    s, cfg = _pipeline_with_one_node_holding_both(three_brokers, tmp_path)
    watched = [
        cfg.control_topic,
        s.topic,
        f"{s.name}.dlq",
        "__consumer_offsets",
        TRANSACTION_STATE_TOPIC,
    ]

    cluster = Cluster(s)
    env = {"TWOPHASE__PARTICIPANT__SWEEP_INTERVAL_MS": "1000"}
    start(cluster, "coordinator", "coord-0")
    start(cluster, "participant", "p-0", env)
    start(cluster, "participant", "p-1", env)
    t0 = time.monotonic()
    try:
        produce(s.bootstrap, s.topic, 0, BATCH)
        settle(s, cluster, set(range(BATCH)), 120)
        # The pipeline's own topics are replicated as configured, the internal ones by the
        # broker defaults: else the kills below would prove nothing.
        assert _full_isr(bootstrap, watched)

        def kill_and_resume(node: int, what: str, batch: int) -> None:
            _stack(Path(three_brokers["TWOPHASE_STACK_DIR"]), "kill-broker", str(node))
            killed = time.monotonic()
            produce(s.bootstrap, s.topic, batch * BATCH, BATCH)
            try:
                wait_until(
                    _quietly(lambda: caught_up(s)),
                    RESUME_BOUND_S,
                    f"commits to catch up after killing node {node} ({what})",
                    every_s=1.0,
                )
            except TimeoutError:
                with contextlib.suppress(KafkaException, LookupError):
                    print(
                        "group offsets",
                        group_offsets(s.bootstrap, cfg.group_id, s.topic, 2),
                        "end offsets",
                        end_offsets(s.bootstrap, s.topic, 2),
                        "control leader",
                        leader_of(bootstrap, cfg.control_topic, 0),
                    )
                cluster.print_logs(80)
                raise
            print(f"node {node} ({what}) killed: caught up in {time.monotonic() - killed:.1f}s")

        # (1) The leader of the control topic's partition, which also coordinates the source
        # group: decisions and votes move, and so do the group's offsets the commit decisions
        # carry (librdkafka's send_offsets_to_transaction then blocked past its timeout, until
        # the leader took its producer for wedged and replaced it).
        control_leader = leader_of(bootstrap, cfg.control_topic, 0)
        assert group_coordinator_of(bootstrap, cfg.group_id) == control_leader
        kill_and_resume(control_leader, "control partition leader, source group coordinator", 1)
        assert leader_of(bootstrap, cfg.control_topic, 0) not in (control_leader, -1)

        _stack(Path(three_brokers["TWOPHASE_STACK_DIR"]), "start-broker", str(control_leader))
        wait_until(
            _quietly(lambda: _full_isr(bootstrap, watched)),
            ISR_TIMEOUT_S,
            f"node {control_leader} back in every in-sync replica set",
        )

        # (2) The node holding the coordinator's transaction state: its Kafka transactions move
        # to a new transaction coordinator.
        txn_node = txn_coordinator_of(bootstrap, cfg.transactional_id)
        kill_and_resume(txn_node, "transaction coordinator", 2)
        assert txn_coordinator_of(bootstrap, cfg.transactional_id) not in (txn_node, -1)

        reports = settle(s, cluster, set(range(3 * BATCH)), 120)
        for name, report in reports.items():
            assert report.ok, (name, report)
        assert all(cluster.alive(n) for n in cluster.procs), "a process died"
        print(f"nodes killed: {control_leader}, then {txn_node}; {time.monotonic() - t0:.0f}s")
    finally:
        cluster.stop_all()
