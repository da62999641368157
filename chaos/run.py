"""``make chaos``: kill -9 and network faults on a live pipeline, then an independent check of
every sink.

One pipeline (PostgreSQL + MongoDB + Parquet files), two coordinators (leader + standby) and three
participants run as real processes on the local stack (``$TWOPHASE_STACK_DIR/stack.env``), while
records are produced over the whole fault phase. Faults come in *episodes* of 1-4 at once:

* a participant dies by SIGKILL at a random moment, or kills itself at a named crash point
  armed while it runs (``TWOPHASE_CRASH_FILE``, see ``twophase/faults.py``): after_prepare,
  before_vote, after_vote, before_commit, mid_commit (between sinks / after the last one);
* the leading coordinator dies at a random moment or at a crash point (after_prepare_sent,
  mid_decision, after_decision), or the standby is killed;
* once each (not in ``--short``): the Kafka broker and PostgreSQL crash and restart
  (``stack.sh restart-kafka --kill``, ``restart-pg --kill``);
* network episodes: every process reaches Kafka, PostgreSQL and MongoDB through Toxiproxy
  proxies of its own (``stack/toxiproxy.sh``, ``harness/toxiproxy.py``), and one link at a time
  gets latency, a bandwidth limit, connection resets, or is cut for 5-60 s (refused, or a silent
  blackhole) -- a participant cut from Kafka but not PostgreSQL and the reverse, the leader cut
  from Kafka, a participant cut from MongoDB half-way through a chunked commit.

Every dead process is restarted after a short delay, as a supervisor would. The next episode
starts once the pipeline has recovered (commits again; bounded), so faults land on a working
pipeline rather than on one still stalled by the previous fault. At the end the run waits for
quiescence (committed group offsets == end offsets, every sink settled), reads the source topic
and every sink directly (``harness.verify``: ids per sink, never the product's own
bookkeeping) and writes ``chaos/results/latest.json``. Exit status 0 only when no sink lost,
duplicated or left anything behind and no process exited unexpectedly.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import psycopg
import yaml
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from pymongo import MongoClient

from chaos.sampler import Sampler
from harness import (
    Cluster,
    Scenario,
    SinkReport,
    control_summary,
    end_offsets,
    group_offsets,
    kafka_nodes,
    read_from,
    record,
    verify,
)
from harness.store_faults import (
    Tmpfs,
    TmpfsRefused,
    fill_connections,
    pg_prepared,
    pg_sessions,
    terminate,
)
from harness.toxiproxy import ToxiproxyError, ToxiproxyServer
from twophase.config import load_config
from twophase.kafka import create_topics

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "chaos" / "results"

PARTICIPANT_POINTS = ("after_prepare", "mid_commit", "after_vote", "before_commit", "before_vote")
COORDINATOR_POINTS = ("after_decision", "mid_decision", "after_prepare_sent")
#: Passes before an armed point fires. mid_commit is passed after each sink of a commit (pg,
#: mongo, files): 1-2 die between sinks, 3 after the last one, before APPLIED.
POINT_COUNTS = {"mid_commit": (1, 3)}
#: An armed point not reached within this long is disarmed and replaced by a plain SIGKILL.
POINT_TIMEOUT_S = 40.0
#: Random kills land this long after the episode's armed points have fired.
KILL_OFFSET_S = (0.0, 4.0)
#: A dead process comes back after this long (a supervisor's restart delay).
RESTART_DELAY_S = (0.3, 3.0)
#: Between episodes: at least this long, and until this many commits since the last restart
#: (the pipeline works again), but never longer than the bound.
GAP_MIN_S = 8.0
RECOVERY_COMMITS = 3
RECOVERY_MAX_S = 75.0
STACK_RECOVERY_MAX_S = 120.0
#: Rough length of one episode, to spread production over the fault phase.
EPISODE_EST_S = 32.0
#: The same for a network episode: 5-60 s of fault, a few seconds of recovery (5-10 s with
#: --short).
NET_EPISODE_EST_S = (45.0, 15.0)


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- the plan ----------------------------------------------------------------------------------


@dataclass
class Fault:
    role: str  # participant | leader | standby
    point: str = ""  # empty: a SIGKILL at a random moment of the episode
    count: int = 1


COORDINATOR_FAULTS = (
    Fault("leader", "after_decision"),
    Fault("leader"),
    Fault("leader", "mid_decision"),
    Fault("standby"),
    Fault("leader", "after_prepare_sent"),
    Fault("leader"),
)


#: The stack crash-restarts of a run, and where in it: (fraction of the episodes, what).
#: "kafka-control-leader" / "kafka-txn-coordinator": the node of a three-broker stack that
#: leads the control topic's partition / holds the pipeline's transactional id's state.
STACK_FAULTS = {
    1: ((0.4, "kafka"), (0.7, "pg")),
    3: ((0.3, "kafka-control-leader"), (0.5, "kafka-txn-coordinator"), (0.7, "pg")),
}
BROKER_FAULTS = ("kafka-control-leader", "kafka-txn-coordinator")


@dataclass
class Episode:
    faults: list[Fault] = field(default_factory=list)
    stack: str = ""  # kafka | pg: a crash-restart of that service instead
    net: NetFault | None = None  # a network fault instead
    store: StoreFault | None = None  # a store fault instead


def make_plan(
    faults: int,
    seed: int,
    short: bool,
    net_faults: int = 0,
    kafka_net: bool = True,
    brokers: int = 1,
    store_faults: int = 0,
    disk: bool = True,
) -> list[Episode]:
    rng = random.Random(seed)
    if short:
        # Every path once: a participant at a crash point, one at a random time, the leader;
        # then a participant cut from PostgreSQL, and one cut from MongoDB mid-commit (or from
        # Kafka, when the broker has the per-process listeners).
        plan = [
            Episode([Fault("participant", "after_vote"), Fault("leader")]),
            Episode([Fault("participant", "mid_commit", 2), Fault("participant")]),
        ]
        if net_faults:
            plan.insert(1, Episode(net=NET_FAULTS[2]))
            plan.append(Episode(net=NET_FAULTS[0] if kafka_net else NET_FAULTS[6]))
        return plan
    episodes: list[Episode] = []
    left = faults
    pi = ci = 0
    while left > 0:
        n = min(left, rng.choice([3, 4, 4]))
        ep = Episode()
        # About one fault in six hits a coordinator, in turn: the leader at each crash point,
        # the leader at a random time, the standby.
        if n == 4 or rng.random() < 0.4:
            ep.faults.append(COORDINATOR_FAULTS[ci % len(COORDINATOR_FAULTS)])
            ci += 1
        n = min(n, len(ep.faults) + 3)  # three participants
        while len(ep.faults) < n:
            if rng.random() < 0.55:
                point = PARTICIPANT_POINTS[pi % len(PARTICIPANT_POINTS)]
                pi += 1
                lo, hi = POINT_COUNTS.get(point, (1, 1))
                ep.faults.append(Fault("participant", point, rng.randint(lo, hi)))
            else:
                ep.faults.append(Fault("participant"))
        left -= n
        episodes.append(ep)
    # The broker and the database crash once each, at about 40% and 70% of the run; with three
    # brokers, the node leading the control partition (~30%) and the one holding the
    # coordinator's transaction state (~50%) instead of the one broker.
    for at, service in STACK_FAULTS[brokers]:
        episodes.insert(round(len(episodes) * at), Episode(stack=service))
    # Network and store episodes spread evenly between the others (network and store faults
    # alternating), the named cases first.
    usable = [f for f in NET_FAULTS if kafka_net or f.service != "kafka"]
    nets = [Episode(net=usable[k % len(usable)]) for k in range(net_faults)]
    kinds = [f for f in STORE_FAULTS if disk or f.kind != "disk_full"]
    stores = [Episode(store=kinds[k % len(kinds)]) for k in range(store_faults)]
    extra = [ep for pair in itertools.zip_longest(nets, stores) for ep in pair if ep is not None]
    base = len(episodes)
    for k, ep in enumerate(extra):
        episodes.insert(round((k + 1) * base / (len(extra) + 1)) + k, ep)
    return episodes


# -- network faults ----------------------------------------------------------------------------

#: Every process reaches each service through a Toxiproxy proxy of its own. Ports: the API at
#: KAFKA_PORT + NET_PORT_OFFSET, then per process i (coord-0, coord-1, p-0..2) Kafka's proxy
#: (the port its broker listener advertises) at +10+i, that listener at +20+i, PostgreSQL's
#: proxy at +30+i and MongoDB's at +40+i: fixed, because the broker's listeners are. With three
#: brokers node N's Kafka proxies and listeners are at those ports + KAFKA_NODE_STRIDE*(N-1), as
#: stack.sh places node N's listeners (its own port too): a process's Kafka link is its proxy
#: to each node.
NET_PORT_OFFSET = 300
KAFKA_NODE_STRIDE = 100
NET_PROCESSES = ("coord-0", "coord-1", "p-0", "p-1", "p-2")
NET_SERVICES = ("kafka", "pg", "mongo")
#: A cut or a degraded link lasts this long (issue #21: 5-60 s); --short keeps to the low end.
NET_DURATION_S = (5.0, 60.0)
SHORT_NET_DURATION_S = (5.0, 10.0)
#: Added latency (ms) and bandwidth (KB/s) of the degraded-link episodes.
NET_LATENCY_MS = (100, 2000)
NET_BANDWIDTH_KBPS = (16, 128)
#: MongoDB cut mid-commit: the chunk size of the chaos pipeline's MongoDB sink, so that a part
#: of a few hundred records is applied in several chunk transactions (the default 1000 would
#: commit the parts of this run in one), the latency put on the participants' MongoDB links
#: while the run looks for a part half applied (it widens the window), and how long it looks.
MONGO_CHUNK = 50
MID_COMMIT_LATENCY_MS = 200
MID_COMMIT_WAIT_S = 40.0


@dataclass
class NetFault:
    kind: str  # latency | bandwidth | reset_peer | partition | blackhole
    role: str  # participant | leader
    service: str  # kafka | pg | mongo
    case: str = ""  # a named case of issue #21, for the log
    mid_commit: bool = False  # mongo: cut only once a participant is half-way through a commit


#: The named cases of issue #21, then degraded links; the full run cycles through these.
NET_FAULTS = (
    NetFault("partition", "participant", "kafka", "participant_cut_from_kafka_not_pg"),
    NetFault("latency", "participant", "pg"),
    NetFault("partition", "participant", "pg", "participant_cut_from_pg_not_kafka"),
    NetFault("bandwidth", "participant", "kafka"),
    NetFault("blackhole", "leader", "kafka", "leader_cut_from_kafka"),
    NetFault("latency", "leader", "kafka"),
    NetFault("partition", "participant", "mongo", "participant_cut_from_mongo_mid_commit", True),
    NetFault("reset_peer", "participant", "pg"),
    NetFault("blackhole", "participant", "kafka", "participant_cut_from_kafka_not_pg"),
    NetFault("latency", "participant", "mongo"),
    NetFault("partition", "leader", "kafka", "leader_cut_from_kafka"),
    NetFault("reset_peer", "participant", "kafka"),
    NetFault("blackhole", "participant", "pg", "participant_cut_from_pg_not_kafka"),
    NetFault("bandwidth", "participant", "mongo"),
)


# -- store faults ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreFault:
    kind: str  # pg_terminate | pg_connlimit | disk_full
    case: str = ""


#: Issue #21's store faults (items 3 and 4), cycled through in order.
STORE_FAULTS = (
    StoreFault("pg_terminate", "participant_sessions_ended_while_prepared"),
    StoreFault("disk_full", "files_sink_disk_full"),
    StoreFault("pg_connlimit", "pg_connection_limit_exhausted"),
)
#: How long the PostgreSQL server stays full, or the files sink's disk.
STORE_DURATION_S = (10.0, 40.0)
#: A terminate waits this long for the participant to hold a prepared part, then ends its
#: sessions anyway.
PREPARED_WAIT_S = 20.0
#: The files sink's tmpfs: a cap, not memory (a tmpfs holds only what is written to it).
FILES_TMPFS_BYTES = 16 << 30
#: What a full disk leaves free: a few parts' worth, which the pipeline's records then fill.
DISK_LEFT_FREE = 160 * 1024
#: What the files sink logs when the disk is full.
ENOSPC = "No space left on device"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class Net:
    """The Toxiproxy server of the run and one proxy per process and service (per Kafka node
    for Kafka: a process's link to Kafka is its proxies to every node)."""

    def __init__(self, s: Scenario, kafka_port: int, kafka: bool, brokers: int = 1) -> None:
        self.s = s
        self.kafka = kafka  # Kafka through proxies too (the brokers have the listeners)
        self.brokers = brokers
        self.base = kafka_port + NET_PORT_OFFSET
        self.server = ToxiproxyServer(self.base, s.workdir / "toxiproxy")
        self.api = self.server.api
        self.pg = _host_port(s.pg_dsn.split("@", 1)[1].split("/", 1)[0])
        self.mongo = _host_port(s.mongo_uri.split("//", 1)[1].split("/", 1)[0])

    def port(self, service: str, name: str, listener: bool = False, node: int = 1) -> int:
        return net_port(self.base, service, name, listener) + KAFKA_NODE_STRIDE * (node - 1)

    def nodes(self, service: str) -> range:
        """The nodes of ``service`` a process has a proxy to (Kafka's brokers; one otherwise)."""
        return range(1, (self.brokers if service == "kafka" else 1) + 1)

    def proxies(self, name: str, service: str) -> list[str]:
        """The proxies that make process ``name``'s link to ``service``."""
        return [f"{name}-{service}" + (f"-{n}" if n > 1 else "") for n in self.nodes(service)]

    def listeners(self) -> str:
        return kafka_listeners(self.base - NET_PORT_OFFSET)

    def clash(self) -> str | None:
        """Why the proxies' ports cannot be had: a service of the stack listens on one of them
        (e.g. TWOPHASE_PG_PORT inside the range the proxies take above TWOPHASE_KAFKA_PORT)."""
        taken = {self.base: "the Toxiproxy API"}
        for n in NET_PROCESSES:
            for service in NET_SERVICES:
                for node in self.nodes(service):
                    taken[self.port(service, n, False, node)] = f"{n}'s {service} proxy"
        for what, port in (("PostgreSQL", self.pg[1]), ("MongoDB", self.mongo[1])):
            if port in taken:
                return (
                    f"{what}'s port {port} is where {taken[port]} must listen (the proxies take "
                    f"{min(taken)}-{max(taken)}, above TWOPHASE_KAFKA_PORT + {NET_PORT_OFFSET}): "
                    "move that service's port or Kafka's"
                )
        return None

    def start(self) -> None:
        self.server.start()
        self.api.reset()
        existing = self.api.proxies()
        for n in NET_PROCESSES:
            for service in NET_SERVICES:
                if service == "kafka" and not self.kafka:
                    continue
                for node, proxy in zip(self.nodes(service), self.proxies(n, service), strict=True):
                    if proxy in existing:
                        self.api.delete(proxy)
                    upstream = {
                        "kafka": f"127.0.0.1:{self.port('kafka', n, True, node)}",
                        "pg": f"{self.pg[0]}:{self.pg[1]}",
                        "mongo": f"{self.mongo[0]}:{self.mongo[1]}",
                    }[service]
                    self.api.create(
                        proxy, f"127.0.0.1:{self.port(service, n, False, node)}", upstream
                    )

    def stop(self) -> None:
        # The server goes anyway; its proxies die with it.
        with contextlib.suppress(ToxiproxyError):
            self.api.reset()
        self.server.stop()

    def env(self, name: str) -> dict[str, str]:
        """The addresses process ``name`` uses (``${ENV:...}`` in its config)."""
        pg = f"127.0.0.1:{self.port('pg', name)}"
        mongo = f"127.0.0.1:{self.port('mongo', name)}"
        return {
            "CHAOS_KAFKA": ",".join(
                f"127.0.0.1:{self.port('kafka', name, False, node)}" for node in self.nodes("kafka")
            )
            if self.kafka
            else self.s.bootstrap,
            "CHAOS_PG_DSN": self.s.pg_dsn.replace(f"{self.pg[0]}:{self.pg[1]}", pg, 1),
            "CHAOS_MONGO_URI": _direct(
                self.s.mongo_uri.replace(f"{self.mongo[0]}:{self.mongo[1]}", mongo, 1)
            ),
        }


def net_port(base: int, service: str, name: str, listener: bool = False) -> int:
    i = NET_PROCESSES.index(name)
    return base + {"kafka": 10, "pg": 30, "mongo": 40}[service] + 10 * listener + i


def kafka_listeners(kafka_port: int) -> str:
    """``TWOPHASE_KAFKA_EXTRA_LISTENERS`` for a broker on ``kafka_port`` (see stack/stack.sh):
    per process, a listener on its port that advertises the port of that process's proxy."""
    base = kafka_port + NET_PORT_OFFSET
    return ",".join(
        f"CHAOS_{n.upper().replace('-', '_')}:{net_port(base, 'kafka', n, True)}:"
        f"{net_port(base, 'kafka', n)}"
        for n in NET_PROCESSES
    )


def _host_port(hp: str) -> tuple[str, int]:
    host, _, port = hp.rpartition(":")
    return host, int(port)


def _direct(uri: str) -> str:
    """With ``replicaSet`` alone pymongo connects to the members the server's ``hello`` names
    -- its own address, past the proxy; ``directConnection`` keeps it on the proxy (a
    single-node replica set, transactions included)."""
    return uri + ("&" if "?" in uri else "/?") + "directConnection=true"


def _direct_env(s: Scenario) -> dict[str, str]:
    return {
        "CHAOS_KAFKA": s.bootstrap,
        "CHAOS_PG_DSN": s.pg_dsn,
        "CHAOS_MONGO_URI": _direct(s.mongo_uri),
    }


def _use_env_addresses(s: Scenario, mongo_chunk: int | None) -> None:
    """Rewrite the pipeline's config so that every process takes its addresses from its own
    environment (``${ENV:...}``): one config file, a proxy per process."""
    cfg = yaml.safe_load(s.config_path.read_text())
    cfg["kafka"]["bootstrap_servers"] = "${ENV:CHAOS_KAFKA}"
    for sink in cfg["sinks"]:
        if sink["type"] == "postgres":
            sink["dsn"] = "${ENV:CHAOS_PG_DSN}"
        elif sink["type"] == "mongodb":
            sink["uri"] = "${ENV:CHAOS_MONGO_URI}"
            if mongo_chunk:
                sink["commit_chunk_size"] = mongo_chunk
    s.config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


# -- processes ---------------------------------------------------------------------------------


@dataclass
class Member:
    name: str
    role: str  # coordinator | participant
    log_path: Path
    pos: int = 0
    partial: bytes = b""
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=30))
    leader: bool = False
    crash_hit: str = ""
    armed: str = ""  # the point armed now
    arm_deadline: float = 0.0
    kill_at: float | None = None
    restart_at: float | None = None
    killed_by_us: str = ""
    started: float = 0.0


class Chaos:
    def __init__(self, s: Scenario, rng: random.Random, net: Net | None = None) -> None:
        self.s = s
        self.rng = rng
        self.net = net
        self.net_faults: list[dict[str, Any]] = []
        self.store_faults: list[dict[str, Any]] = []
        self.disk: Tmpfs | None = None  # the files sink's tmpfs, when a full disk can be made
        self.cluster = Cluster(s)
        self.arm_dir = s.workdir / "arm"
        self.arm_dir.mkdir(parents=True, exist_ok=True)
        self.members: dict[str, Member] = {}
        #: Processes no kill episode picks (a soak's witness: it lives the whole run, so its
        #: memory and descriptors are judged; network faults and stack restarts still hit it).
        self.spared: set[str] = set()
        self.faults: list[dict[str, Any]] = []
        self.unexpected: list[dict[str, Any]] = []
        self.episodes: list[dict[str, Any]] = []
        self.commit_times: list[float] = []
        self.t0 = time.monotonic()
        self._arm_seq = 0
        # The pipeline's, for the three-broker faults (set by run()).
        self.control_topic = ""
        self.transactional_id = ""

    def now(self) -> float:
        return time.monotonic() - self.t0

    # process control

    def start(self, name: str, role: str) -> None:
        path = self.cluster.logs / f"{name}.log"
        m = self.members.setdefault(name, Member(name, role, path))
        self._read(m)  # whatever the last incarnation wrote
        m.leader = False
        m.crash_hit = m.armed = m.killed_by_us = ""
        m.kill_at = m.restart_at = None
        m.started = self.now()
        self._arm_file(name).unlink(missing_ok=True)
        addresses = self.net.env(name) if self.net else _direct_env(self.s)
        self.cluster.start(
            role, name, {"TWOPHASE_CRASH_FILE": str(self._arm_file(name)), **addresses}
        )

    def _arm_file(self, name: str) -> Path:
        return self.arm_dir / name

    def arm(self, name: str, point: str, count: int) -> None:
        m = self.members[name]
        self._arm_seq += 1
        tmp = self._arm_file(name).with_suffix(".tmp")
        tmp.write_text(f"{point}:{count}:{self._arm_seq}\n")
        tmp.rename(self._arm_file(name))
        m.armed = point
        m.arm_deadline = self.now() + POINT_TIMEOUT_S
        log(f"armed {name} at {point}:{count}")

    def disarm(self, name: str) -> None:
        self._arm_file(name).unlink(missing_ok=True)
        self.members[name].armed = ""

    def alive(self, name: str) -> bool:
        return name in self.cluster.procs and self.cluster.alive(name)

    def all_alive(self) -> bool:
        return all(self.alive(n) for n in self.members)

    def sigkill(self, name: str, why: str) -> bool:
        m = self.members[name]
        if not self.alive(name):
            return False
        m.killed_by_us = why
        was_leader = m.leader
        self.cluster.kill(name, signal.SIGKILL)
        self.faults.append(
            {
                "t": round(self.now(), 1),
                "target": name,
                "role": m.role,
                "how": "sigkill",
                "why": why,
                **({"leader": was_leader} if m.role == "coordinator" else {}),
            }
        )
        log(f"SIGKILL {name}{' (leader)' if was_leader else ''}: {why}")
        return True

    def _read(self, m: Member) -> None:
        """New log lines of ``m``: leadership, crash points, commits."""
        try:
            with m.log_path.open("rb") as f:
                f.seek(m.pos)
                data = f.read()
        except FileNotFoundError:
            return
        m.pos += len(data)
        lines = (m.partial + data).split(b"\n")
        m.partial = lines.pop()
        for raw in lines:
            line = raw.decode(errors="replace")
            m.tail.append(line)
            if "crash point " in line and " reached" in line:
                m.crash_hit = line.split("crash point ", 1)[1].split()[0]
            if m.role != "coordinator":
                continue
            if "is now the leader" in line:
                m.leader = True
            elif "stepping down" in line or "fenced" in line:
                m.leader = False
            elif " committed (" in line:
                self.commit_times.append(self.now())

    def leader(self) -> str | None:
        return next(
            (n for n, m in self.members.items() if m.leader and self.alive(n)),
            None,
        )

    def commits_since(self, t: float) -> int:
        return sum(1 for c in self.commit_times if c >= t)

    def last_start(self) -> float:
        return max(m.started for m in self.members.values())

    # the loop

    def tick(self) -> None:
        now = self.now()
        for m in self.members.values():
            self._read(m)
            proc = self.cluster.procs.get(m.name)
            if proc is None:
                continue
            if proc.poll() is not None and m.restart_at is None:
                self._died(m, proc.returncode)
            if m.restart_at is not None:
                if now >= m.restart_at:
                    self.start(m.name, m.role)
                continue
            if m.armed and now >= m.arm_deadline:
                point = m.armed
                self.disarm(m.name)
                self.sigkill(m.name, f"{point} not reached in {POINT_TIMEOUT_S:.0f}s")
            elif m.kill_at is not None and now >= m.kill_at:
                m.kill_at = None
                self.sigkill(m.name, "random time")

    def _died(self, m: Member, rc: int) -> None:
        self._read(m)
        m.leader = False
        m.kill_at = None
        m.restart_at = self.now() + self.rng.uniform(*RESTART_DELAY_S)
        armed, m.armed = m.armed, ""
        self._arm_file(m.name).unlink(missing_ok=True)
        if m.killed_by_us:
            return
        if rc == -signal.SIGKILL and m.crash_hit:
            self.faults.append(
                {
                    "t": round(self.now(), 1),
                    "target": m.name,
                    "role": m.role,
                    "how": "crash_point",
                    "point": m.crash_hit,
                }
            )
            log(f"{m.name} died at crash point {m.crash_hit}")
            return
        tail = "\n".join(list(m.tail)[-15:])
        self.unexpected.append(
            {"t": round(self.now(), 1), "target": m.name, "rc": rc, "armed": armed, "tail": tail}
        )
        log(f"UNEXPECTED exit of {m.name} rc={rc}\n{tail}")

    def idle(self, seconds: float, until: Callable[[], bool] | None = None) -> bool:
        """Keep supervising for ``seconds`` or until ``until()``; True if ``until`` came true."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.tick()
            if until is not None and until():
                return True
            time.sleep(0.1)
        return False

    # episodes

    def run_episode(self, i: int, ep: Episode) -> None:
        started = self.now()
        rec: dict[str, Any] = {"i": i, "t": round(started, 1)}
        before = len(self.faults)
        if ep.stack:
            rec["stack"] = self._stack_restart(ep.stack)
            bound = STACK_RECOVERY_MAX_S
        else:
            # A coordinator fault needs a leader: wait for the last failover to finish (bounded).
            if any(f.role in ("leader", "standby") for f in ep.faults):
                self.idle(60, lambda: self.leader() is not None)
            coords = [n for n, m in self.members.items() if m.role == "coordinator"]
            parts = [
                n
                for n, m in self.members.items()
                if m.role == "participant" and n not in self.spared
            ]
            self.rng.shuffle(parts)
            lead = self.leader()
            kills: list[str] = []
            for f in ep.faults:
                if f.role == "participant":
                    target = next((p for p in parts if self.alive(p)), None)
                    if target is not None:
                        parts.remove(target)
                elif f.role == "leader":
                    target = lead
                else:
                    target = next((c for c in coords if c != lead and self.alive(c)), None)
                if target is None:
                    log(f"episode {i}: no live {f.role} for {f.point or 'a kill'}; skipped")
                    continue
                if f.point:
                    self.arm(target, f.point, f.count)
                else:
                    kills.append(target)
            # Armed points first: a commit-phase point needs a commit, which a random kill of
            # another process would hold up for a whole recovery. They fire within seconds on a
            # working pipeline; the random kills follow right after.
            self.idle(POINT_TIMEOUT_S + 5, lambda: not any(m.armed for m in self.members.values()))
            for target in kills:
                if self.alive(target):
                    self.members[target].kill_at = self.now() + self.rng.uniform(*KILL_OFFSET_S)
            self.idle(
                POINT_TIMEOUT_S + 10,
                lambda: not any(m.armed or m.kill_at is not None for m in self.members.values()),
            )
            bound = RECOVERY_MAX_S
        rec["faults"] = [
            f"{f['target']}:{f.get('point') or f['why']}" for f in self.faults[before:]
        ]
        # Recovered: everyone is back and the pipeline has committed a few times since the
        # last restart of a process or of the stack.
        faulted = self.now()
        hit = self.idle(
            bound,
            lambda: (
                self.now() - started >= GAP_MIN_S
                and self.all_alive()
                and self.commits_since(max(self.last_start(), faulted)) >= RECOVERY_COMMITS
            ),
        )
        rec["recovery_s"] = round(self.now() - started, 1)
        rec["first_commit_after_s"] = self._first_commit_after(faulted)
        if not hit:
            rec["not_recovered"] = True
            log(f"episode {i}: no {RECOVERY_COMMITS} commits within {bound:.0f}s; going on")
        self.episodes.append(rec)

    def _first_commit_after(self, t: float) -> float | None:
        first = next((c for c in self.commit_times if c >= t), None)
        return None if first is None else round(first - t, 1)

    def run_net_episode(self, i: int, f: NetFault, short: bool) -> None:
        """One network fault on one process's link to one service, then the recovery.

        ``recovery_s`` counts from the end of the fault (the link healed) until the pipeline
        has committed RECOVERY_COMMITS times with every process up, like a kill episode's."""
        assert self.net is not None
        started = self.now()
        rec: dict[str, Any] = {"i": i, "t": round(started, 1), "net": f.kind}
        rec.update({"service": f.service, "role": f.role, **({"case": f.case} if f.case else {})})
        if f.role == "leader":
            self.idle(60, lambda: self.leader() is not None)
            target = self.leader()
        else:
            live = [n for n, m in self.members.items() if m.role == "participant" and self.alive(n)]
            target = self.rng.choice(live) if live else None
        if target is None:
            log(f"episode {i}: no live {f.role} for a network fault; skipped")
            rec["skipped"] = True
            self.episodes.append(rec)
            return
        duration = self.rng.uniform(*(SHORT_NET_DURATION_S if short else NET_DURATION_S))
        if f.mid_commit:
            target = self._mid_commit(target, rec)
        proxy = f"{target}-{f.service}"
        links = self.net.proxies(target, f.service)  # Kafka: the proxy to each node
        api = self.net.api
        detail: dict[str, Any] = {}
        if f.kind == "latency":
            ms = self.rng.randint(*NET_LATENCY_MS)
            detail = {"latency_ms": ms}
            for link in links:
                api.add_toxic(link, "latency", {"latency": ms, "jitter": ms // 10})
        elif f.kind == "bandwidth":
            kbps = self.rng.randint(*NET_BANDWIDTH_KBPS)
            detail = {"rate_kbps": kbps}
            for link in links:
                api.add_toxic(link, "bandwidth", {"rate": kbps})
        elif f.kind == "reset_peer":
            # Every connection is reset (RST) once it has lived this long, over and over.
            ms = self.rng.randint(0, 2000)
            detail = {"reset_after_ms": ms}
            for link in links:
                api.add_toxic(link, "reset_peer", {"timeout": ms})
        elif f.kind == "blackhole":
            # A silent partition: nothing gets through and nothing is refused or closed; what
            # was sent arrives when the link heals (as TCP would retransmit it). Toxiproxy's
            # `timeout` toxic drops the bytes instead, which no network does, so: a latency
            # longer than the fault, both ways, removed at the end.
            for link in links:
                for stream in ("upstream", "downstream"):
                    api.add_toxic(
                        link, "latency", {"latency": 600_000}, name=f"hold_{stream}", stream=stream
                    )
        else:  # partition: open connections closed, new ones refused
            for link in links:
                api.set_enabled(link, False)
        cut = self.now()
        rec.update({"target": target, **detail})
        log(
            f"episode {i}: {f.kind} on {proxy} for {duration:.0f}s"
            f"{f' ({f.case})' if f.case else ''} {detail or ''}"
        )
        self.idle(duration)
        for link in links:
            api.heal(link)
        healed = self.now()
        rec["fault_s"] = round(healed - cut, 1)
        # Whether the pipeline went on committing without the process (or its link) meanwhile.
        rec["commits_during_fault"] = sum(1 for c in self.commit_times if cut <= c < healed)
        self.net_faults.append(
            {
                "t": round(cut, 1),
                "target": target,
                "role": "coordinator" if f.role == "leader" else "participant",
                "how": f.kind,
                "service": f.service,
                "seconds": rec["fault_s"],
                **({"case": f.case} if f.case else {}),
                **detail,
            }
        )
        log(f"episode {i}: {proxy} healed after {rec['fault_s']}s")
        self._recover_after(i, rec, healed, "the heal")

    def run_any(self, i: int, ep: Episode, short: bool) -> None:
        if ep.net is not None:
            self.run_net_episode(i, ep.net, short)
        elif ep.store is not None:
            self.run_store_episode(i, ep.store)
        else:
            self.run_episode(i, ep)

    def run_store_episode(self, i: int, f: StoreFault) -> None:
        """One store fault, then the recovery: ``recovery_s`` counts from the fault's end
        (sessions ended; the server or the disk given room again) until the pipeline has
        committed RECOVERY_COMMITS times with every process up."""
        started = self.now()
        rec: dict[str, Any] = {"i": i, "t": round(started, 1), "store": f.kind, "case": f.case}
        duration = self.rng.uniform(*STORE_DURATION_S)
        detail: dict[str, Any] = {}
        cut = self.now()
        try:
            if f.kind == "pg_terminate":
                detail = self._terminate_prepared(i)
            elif f.kind == "pg_connlimit":
                detail = self._fill_server(i, duration)
            else:
                detail = self._fill_disk(i, duration)
        except (psycopg.Error, OSError) as exc:  # the fault could not be made: say so
            log(f"episode {i}: {f.kind} not made: {exc}")
            detail["not_made"] = str(exc)
        ended = self.now()
        rec.update(detail)
        rec["fault_s"] = round(ended - cut, 1)
        rec["commits_during_fault"] = sum(1 for c in self.commit_times if cut <= c < ended)
        self.store_faults.append({"t": round(cut, 1), "how": f.kind, "case": f.case, **detail})
        self._recover_after(i, rec, ended, "its end")

    def _recover_after(self, i: int, rec: dict[str, Any], since: float, what: str) -> None:
        """Wait (bounded) until every process is up and the pipeline has committed
        RECOVERY_COMMITS times since ``since`` (a fault's end) and its last restart; record."""
        hit = self.idle(
            RECOVERY_MAX_S,
            lambda: (
                self.all_alive()
                and self.commits_since(max(self.last_start(), since)) >= RECOVERY_COMMITS
            ),
        )
        rec["recovery_s"] = round(self.now() - since, 1)
        rec["first_commit_after_s"] = self._first_commit_after(since)
        if not hit:
            rec["not_recovered"] = True
            log(
                f"episode {i}: no {RECOVERY_COMMITS} commits within {RECOVERY_MAX_S:.0f}s of {what}"
            )
        self.episodes.append(rec)

    def _terminate_prepared(self, i: int) -> dict[str, Any]:
        """``pg_terminate_backend`` of every PostgreSQL session of a participant, at a moment
        it holds a prepared part (waited for, bounded; else at once). The prepared transaction
        outlives its sessions; the participant must finish it by gid from a new one."""
        pipeline = self.s.name
        with psycopg.connect(self.s.pg_dsn, autocommit=True) as admin:
            found: list[str] = []

            def prepared() -> bool:
                found[:] = pg_prepared(admin, pipeline)
                return bool(found)

            self.idle(PREPARED_WAIT_S, prepared)
            if found:
                gid = found[-1]
                target = gid.rsplit("~", 1)[1]
            else:
                live = [n for n, m in self.members.items() if m.role == "participant"]
                target, gid = self.rng.choice(live), ""
            pids = pg_sessions(admin, pipeline, target)
            ended = terminate(admin, pids)
            outlived = bool(gid) and gid in pg_prepared(admin, pipeline, target)
        log(
            f"episode {i}: pg_terminate_backend of {ended} sessions of {target}"
            + (f" while {gid} was prepared (outlived them: {outlived})" if gid else "")
        )
        return {
            "target": target,
            "sessions": ended,
            "prepared_gid": gid or None,
            "gid_outlived": outlived,
        }

    def _fill_server(self, i: int, duration: float) -> dict[str, Any]:
        """PostgreSQL filled to ``max_connections`` for ``duration``: the pipeline's sessions
        ended once so that it must reconnect into the full server, then refused."""
        with psycopg.connect(self.s.pg_dsn, autocommit=True) as probe:
            row = probe.execute("SHOW max_connections").fetchone()
        limit = int(row[0]) if row else 100
        fillers, refusal = fill_connections(self.s.pg_dsn, limit)
        if not fillers:  # refused from the first (a restart under way): no fault made
            raise OSError(f"PostgreSQL took no connection: {refusal.strip()[:200]}")
        try:
            control = fillers[0]
            ended = 0
            for _ in range(20):  # freed slots are taken again until none of ours is left
                pids = pg_sessions(control, self.s.name)
                ended += terminate(control, pids)
                more, refusal = fill_connections(self.s.pg_dsn, limit)
                fillers += more
                if not pids:
                    break
            log(
                f"episode {i}: PostgreSQL full ({len(fillers)} connections, {ended} of the "
                f"pipeline's ended) for {duration:.0f}s: {refusal.strip()[:80]}"
            )
            self.idle(duration)
        finally:
            for conn in fillers:
                conn.close()
        return {
            "connections": len(fillers),
            "sessions_ended": ended,
            "refusal": refusal.strip()[:200],
        }

    def _fill_disk(self, i: int, duration: float) -> dict[str, Any]:
        """The files sink's tmpfs shrunk to what it holds for ``duration`` (the pipeline's
        records fill the little left), then given its room back."""
        assert self.disk is not None
        logs = [self.cluster.logs / f"{n}.log" for n in self.members]
        sizes = {p: _size(p) for p in logs}  # only what is logged from here on is read
        size = self.disk.fill(DISK_LEFT_FREE)
        try:
            log(f"episode {i}: files sink disk full ({size} bytes) for {duration:.0f}s")
            self.idle(duration)
        finally:
            for attempt in range(5):  # the room must come back, or the run goes on full
                try:
                    self.disk.resize(FILES_TMPFS_BYTES)
                    break
                except OSError:
                    if attempt == 4:
                        raise
                    time.sleep(1)
        met = sum(read_from(p, sizes[p]).count(ENOSPC) for p in logs)
        log(f"episode {i}: files sink disk has room again; {met} '{ENOSPC}' lines logged")
        return {"disk_bytes": size, "enospc_logged": met}

    def _mid_commit(self, fallback: str, rec: dict[str, Any]) -> str:
        """Wait (bounded) until a participant is half-way through applying a part in MongoDB
        -- its marker prepared, leased by it, some chunks applied and not all -- and return it.
        Read from MongoDB directly (the markers, see participants/sinks/mongodb), so the cut
        that follows lands inside a chunked commit, not near one. The participants' MongoDB
        links are slowed meanwhile, which makes parts and the window larger."""
        assert self.net is not None
        api = self.net.api
        parts = [n for n, m in self.members.items() if m.role == "participant"]
        for p in parts:
            api.add_toxic(f"{p}-mongo", "latency", {"latency": MID_COMMIT_LATENCY_MS}, name="slow")
        client: MongoClient[dict[str, Any]] = MongoClient(
            _direct(self.s.mongo_uri), serverSelectionTimeoutMS=5000
        )
        markers = client[self.s.table]["twophase_parts"]
        found: dict[str, Any] = {}

        def half_applied() -> bool:
            doc = markers.find_one(
                {
                    "kind": "part",
                    "state": "prepared",
                    "applied": {"$gt": 0},
                    "lease_holder": {"$in": parts},
                },
                {"lease_holder": 1, "applied": 1, "records": 1, "txn": 1},
            )
            if doc is not None and doc["applied"] < doc.get("records", 0):
                found.update(doc)
                return True
            return False

        try:
            self.idle(MID_COMMIT_WAIT_S, half_applied)
        finally:
            client.close()
            for p in parts:
                # The target's stays until its link heals: the cut follows at once.
                if p != found.get("lease_holder"):
                    api.remove_toxic(f"{p}-mongo", "slow")
        if not found:
            log(f"no participant half-way through a MongoDB commit in {MID_COMMIT_WAIT_S:.0f}s")
            rec["mid_commit"] = None
            return fallback
        rec["mid_commit"] = {k: found[k] for k in ("txn", "applied", "records")}
        return str(found["lease_holder"])

    def _broker_of(self, service: str) -> int:
        """The three-broker stack's node that ``service`` (a BROKER_FAULTS entry) names now."""
        if service == "kafka-control-leader":
            return kafka_nodes.leader_of(self.s.bootstrap, self.control_topic, 0)
        return kafka_nodes.txn_coordinator_of(self.s.bootstrap, self.transactional_id)

    def _stack_restart(self, service: str) -> dict[str, Any]:
        command = [f"restart-{service}", "--kill"]
        node = None
        if service in BROKER_FAULTS:
            node = self._broker_of(service)
            command = ["restart-broker", str(node), "--kill"]
        log(f"crash-restarting {service}: stack.sh {' '.join(command)}")
        t = self.now()
        with (self.cluster.logs / f"stack-restart-{service}.log").open("ab") as out:
            proc = subprocess.Popen(
                ["bash", str(REPO / "stack" / "stack.sh"), *command],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=os.environ.copy(),
            )
            self.idle(300, lambda: proc.poll() is not None)
        if proc.poll() is None:
            proc.kill()
        rc = proc.wait()
        rec = {"service": service, "mode": "--kill", "t": round(t, 1), "rc": rc}
        if node is not None:
            rec["node"] = node
        rec["seconds"] = round(self.now() - t, 1)
        log(f"{service} restarted in {rec['seconds']}s (rc {rc})")
        if rc != 0:
            raise RuntimeError(f"stack.sh {' '.join(command)} failed (rc {rc})")
        return rec


# -- source side -------------------------------------------------------------------------------


class Feeder(threading.Thread):
    """Produces ``count`` records evenly over ``seconds``, surviving a broker restart."""

    def __init__(self, s: Scenario, count: int, seconds: float, seed: int) -> None:
        super().__init__(name="feeder", daemon=True)
        self.s, self.count, self.seconds, self.seed = s, count, seconds, seed
        self.failed: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 -- handed to the main thread
            self.error = exc

    def _run(self) -> None:
        rng = random.Random(self.seed)
        p = Producer(
            {
                "bootstrap.servers": self.s.bootstrap,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 20,
                # Outlive a broker restart rather than give up on a record.
                "message.timeout.ms": 600_000,
            }
        )

        def done(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                self.failed.append(err.str())

        started = time.monotonic()
        i = 0
        while i < self.count:
            elapsed = time.monotonic() - started
            due = max(i + 1, min(self.count, math.ceil(self.count * elapsed / self.seconds)))
            while i < due:
                try:
                    p.produce(
                        self.s.topic, key=str(i).encode(), value=record(i, rng), on_delivery=done
                    )
                    i += 1
                except BufferError:
                    p.poll(0.1)
            p.poll(0.25)
        if p.flush(600) > 0:
            self.failed.append("records still undelivered after 600 s")


def source_ids(s: Scenario) -> tuple[set[int], int]:
    """Every id in the source topic (read_committed), and how many records repeat an id."""
    c = Consumer(
        {
            "bootstrap.servers": s.bootstrap,
            "group.id": f"chaos-source-{uuid.uuid4().hex[:6]}",
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    ends = end_offsets(s.bootstrap, s.topic, s.partitions)
    todo = {p for p in range(s.partitions) if ends[p] > 0}
    c.assign([TopicPartition(s.topic, p, 0) for p in sorted(todo)])
    ids: set[int] = set()
    dup = 0
    last = time.monotonic()
    while todo and time.monotonic() - last < 60:
        for m in c.consume(10_000, 1.0):
            last = time.monotonic()
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    todo.discard(m.partition() or 0)
                continue
            i = orjson.loads(m.value() or b"{}")["id"]
            dup += i in ids
            ids.add(i)
    c.close()
    if todo:
        raise RuntimeError(f"could not read the source topic to its end (partitions {todo})")
    return ids, dup


# -- the run -----------------------------------------------------------------------------------


def _counts(r: SinkReport) -> dict[str, int]:
    return {
        "lost": r.missing,
        "duplicated": r.duplicated,
        "orphaned_prepared": r.orphaned_prepared,
        "staging_leftovers": r.staging_leftovers,
    }


def _mix(faults: list[dict[str, Any]]) -> dict[str, int]:
    mix: dict[str, int] = collections.Counter()
    for f in faults:
        if f["how"] == "crash_point":
            key = f"{f['role']}:crash_point:{f['point']}"
        elif f["role"] == "coordinator":
            key = f"coordinator:sigkill:{'leader' if f.get('leader') else 'standby'}"
        elif "not reached" in f["why"]:
            key = "participant:sigkill:point_not_reached"
        else:
            key = "participant:sigkill:random"
        mix[key] += 1
    return dict(sorted(mix.items()))


def _kafka_listeners(net: Net, restart: bool) -> bool:
    """Whether the broker has the per-process listeners Kafka's proxies forward to; with
    ``restart``, restart it (cleanly) with them when it has not. A Kafka client learns the
    broker's address from metadata, so a proxy in front of the bootstrap address alone would be
    bypassed: each process needs a listener advertising its own proxy's port."""
    spec = net.listeners()
    ports = [net.port("kafka", n, True, node) for n in NET_PROCESSES for node in net.nodes("kafka")]
    if not all(_listening(p) for p in ports) and restart:
        log("restarting Kafka with a listener per process (TWOPHASE_KAFKA_EXTRA_LISTENERS)")
        rc = subprocess.run(
            ["bash", str(REPO / "stack" / "stack.sh"), "restart-kafka"],
            env={**os.environ, "TWOPHASE_KAFKA_EXTRA_LISTENERS": spec},
            stdout=subprocess.DEVNULL,
        ).returncode
        if rc != 0:  # stack.sh said why on stderr
            log(f"stack.sh restart-kafka with the listeners failed (rc {rc}); no Kafka link faults")
    if not all(_listening(p) for p in ports):
        return False
    # The broker's crash-restart later in the run must keep them.
    os.environ["TWOPHASE_KAFKA_EXTRA_LISTENERS"] = spec
    return True


# -- the soak ----------------------------------------------------------------------------------

#: RSS and open descriptors of every process, this often (chaos/sampler.py).
SAMPLE_S = 5.0
#: A process incarnation is judged for growth only when it lived this long (the soak kills
#: processes every few minutes; those that escape long enough say whether anything leaks).
SOAK_JUDGE_S = 600.0
#: Between the starts of two soak faults, uniformly (issue #21: every 30-120 s), and never
#: before the previous fault's recovery.
SOAK_GAP_S = (30.0, 120.0)
#: The participant a soak's kill episodes spare (it still meets every other fault).
SOAK_WITNESS = "p-2"
#: Share of each fault kind among the soak's episodes (the rest are kill episodes).
SOAK_STACK_SHARE, SOAK_NET_SHARE, SOAK_STORE_SHARE = 0.08, 0.30, 0.12


def soak_episodes(
    seed: int, brokers: int, kafka_net: bool, net: bool, mongo: bool = True, disk: bool = True
) -> Iterator[Episode]:
    """The soak's endless random mix of every fault kind: kill episodes (the full run's, in
    its order), network faults (when Toxiproxy runs), stack crash-restarts in turn."""
    rng = random.Random(seed)
    kills = [e for e in make_plan(2000, seed, False) if not e.stack]
    stores = [f for f in STORE_FAULTS if disk or f.kind != "disk_full"]
    nets = [f for f in NET_FAULTS if kafka_net or f.service != "kafka"] if net else []
    if not mongo:
        nets = [f for f in nets if f.service != "mongo"]
    stacks = [service for _, service in STACK_FAULTS[brokers]]
    k = n = st = sf = 0
    while True:
        r = rng.random()
        if r < SOAK_STACK_SHARE:
            yield Episode(stack=stacks[st % len(stacks)])
            st += 1
        elif r < SOAK_STACK_SHARE + SOAK_NET_SHARE and nets:
            yield Episode(net=nets[n % len(nets)])
            n += 1
        elif r < SOAK_STACK_SHARE + SOAK_NET_SHARE + SOAK_STORE_SHARE:
            yield Episode(store=stores[sf % len(stores)])
            sf += 1
        else:
            yield kills[k % len(kills)]
            k += 1


def _soak(
    chaos: Chaos, args: argparse.Namespace, brokers: int, kafka_net: bool, deadline: float
) -> None:
    """Fault after fault until ``deadline``, one every 30-120 s (after the last recovered)."""
    rng = random.Random(args.seed + 7)
    episodes = soak_episodes(
        args.seed, brokers, kafka_net, chaos.net is not None, args.mongo, chaos.disk is not None
    )
    for i, ep in enumerate(episodes):
        if time.monotonic() >= deadline:
            return
        started = time.monotonic()
        chaos.run_any(i, ep, False)
        next_at = min(deadline, started + rng.uniform(*SOAK_GAP_S))
        chaos.idle(max(0.0, next_at - time.monotonic()))


def _pids(chaos: Chaos) -> dict[str, int]:
    """The run's processes now (name -> pid) and the stack's servers (``stack:<name>``)."""
    pids = {name: proc.pid for name, proc in chaos.cluster.procs.items() if proc.poll() is None}
    run_dir = Path(os.environ.get("TWOPHASE_STACK_DIR", REPO / ".stack")) / "run"
    for pid_file in run_dir.glob("*.pid"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            pids[f"stack:{pid_file.stem}"] = int(pid_file.read_text().split()[0])
    return pids


def _kinds(chaos: Chaos) -> dict[str, int]:
    """How many faults of each kind: kills, crash points, stack restarts, network faults."""
    kinds: dict[str, int] = collections.Counter(f["how"] for f in chaos.faults)
    for e in chaos.episodes:
        if e.get("stack"):
            kinds[f"{e['stack']['service']}_crash_restart"] += 1
    kinds.update(f["how"] for f in chaos.net_faults)
    kinds.update(f["how"] for f in chaos.store_faults if "not_made" not in f)
    return dict(sorted(kinds.items()))


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    name = f"chaos-{uuid.uuid4().hex[:6]}"
    workdir = Path(args.workdir) if args.workdir else RESULTS / name
    # The product's default commit settings (1 s interval, 10 s vote timeout).
    s = Scenario.on_stack(
        name, workdir, partitions=6, interval_ms=1000, vote_timeout_ms=10_000, mongo=args.mongo
    )
    s.write()
    # The files sink on a tmpfs of its own, which a full-disk episode shrinks to what it holds.
    disk: Tmpfs | None = None
    disk_refused = ""
    if args.store_faults or args.soak:
        try:
            disk = Tmpfs(s.files_path, FILES_TMPFS_BYTES)
        except TmpfsRefused as exc:
            disk_refused = str(exc)
            log(f"no full-disk episodes: {exc}")
    s.prepare_stores()
    brokers = s.replication_factor  # the stack's broker count
    net: Net | None = None
    if args.net_faults:
        kafka_port = int(s.bootstrap.split(",")[0].rsplit(":", 1)[1])
        net = Net(s, kafka_port, kafka=False, brokers=brokers)
        if (why := net.clash()) is not None:
            raise SystemExit(f"chaos: no room for the network proxies: {why}")
        # --short does not restart a broker others test against: Kafka's links are cut only
        # when the stack was started with the listeners (`make stack-up` gives them).
        net.kafka = _kafka_listeners(net, restart=not args.short)
        try:
            net.start()
        except BaseException:
            net.stop()
            raise
    pipeline_cfg = load_config(s.config_path)
    create_topics(pipeline_cfg)
    kafka_net = bool(net and net.kafka)
    if args.soak:
        plan: list[Episode] = []  # drawn as the soak goes (soak_episodes)
        args.records = int(args.rate * args.soak * 60)
    else:
        plan = make_plan(
            args.faults,
            args.seed,
            args.short,
            args.net_faults,
            kafka_net,
            brokers=brokers,
            store_faults=args.store_faults,
            disk=disk is not None,
        )
    # Small chunks only where a cut mid-commit needs them: they cost MongoDB throughput.
    mid_commit = any(e.net and e.net.mid_commit for e in plan) or bool(
        args.soak and args.mongo and net
    )
    _use_env_addresses(s, mongo_chunk=MONGO_CHUNK if mid_commit else None)
    n_faults = sum(len(e.faults) for e in plan)
    n_net = sum(1 for e in plan if e.net)
    est = sum(
        NET_EPISODE_EST_S[args.short] if e.net else EPISODE_EST_S * (1.5 if e.stack else 1)
        for e in plan
    )
    log(
        f"pipeline {name}: {args.records} records, {len(plan)} episodes, {n_faults} planned "
        f"kills, {n_net} network faults (Kafka links: {bool(net and net.kafka)}); "
        f"logs in {workdir / 'logs'}"
    )
    chaos = Chaos(s, random.Random(args.seed + 1), net)
    chaos.disk = disk
    chaos.control_topic = pipeline_cfg.control_topic
    chaos.transactional_id = pipeline_cfg.transactional_id
    if args.soak:
        # One participant never killed lives the whole soak: the leak verdict needs a process
        # that lived long, and with a kill every minute or two hardly any other does.
        chaos.spared = {SOAK_WITNESS}
    for c in ("coord-0", "coord-1"):
        chaos.start(c, "coordinator")
    for i in range(3):
        chaos.start(f"p-{i}", "participant")
    produce_s = args.soak * 60 if args.soak else max(20.0, est * 0.85)
    feeder = Feeder(s, args.records, produce_s, args.seed)
    sampler = Sampler(partial(_pids, chaos), SAMPLE_S)
    phases: dict[str, float] = {}
    caught_up = settled = False
    source_dups = 0
    expected: set[int] = set()
    reports: dict[str, SinkReport] = {}
    try:
        # Faults land on a working pipeline: wait for the first commits.
        chaos.idle(120, lambda: len(chaos.commit_times) >= 2)
        feeder.start()
        sampler.start()
        if args.soak:
            _soak(chaos, args, brokers, kafka_net, time.monotonic() + args.soak * 60)
        for i, ep in enumerate(plan):
            chaos.run_any(i, ep, args.short)
        # A planned kill can be lost (its target died of something else first): top up.
        extra = 0
        target = n_faults if args.short else args.faults
        while not args.soak and len(chaos.faults) < target and extra < 5:
            short = target - len(chaos.faults)
            for ep in make_plan(short, args.seed + 100 + extra, False):
                if not ep.stack:
                    chaos.run_episode(len(chaos.episodes), ep)
                    break
            extra += 1
        phases["faults_done_s"] = round(time.monotonic() - started, 1)
        log(f"fault phase over: {len(chaos.faults)} kills; waiting for the producer")
        chaos.idle(900, lambda: not feeder.is_alive())
        if feeder.error is not None or feeder.failed:
            raise RuntimeError(f"producer failed: {feeder.error or feeder.failed[:3]}")
        phases["produced_s"] = round(time.monotonic() - started, 1)
        ends = end_offsets(s.bootstrap, s.topic, s.partitions)
        group = f"twophase.{s.name}"

        def at_end() -> bool:
            try:
                return group_offsets(s.bootstrap, group, s.topic, s.partitions) == ends
            except Exception as exc:  # noqa: BLE001 -- a failing probe is no answer
                log(f"probe failed: {exc}")
                return False

        next_probe = [0.0]

        def probe_every(seconds: float, fn: Callable[[], bool]) -> Callable[[], bool]:
            def check() -> bool:
                if time.monotonic() < next_probe[0]:
                    return False
                next_probe[0] = time.monotonic() + seconds
                return fn()

            return check

        log("waiting for the group's committed offsets to reach the end offsets")
        caught_up = chaos.idle(args.settle, probe_every(3.0, at_end))
        phases["caught_up_s"] = round(time.monotonic() - started, 1)
        expected, source_dups = source_ids(s)

        def sinks_ok() -> bool:
            reports.update(verify(s, expected))
            return all(r.ok for r in reports.values())

        log("waiting for every sink to settle")
        next_probe[0] = 0.0
        settled = caught_up and chaos.idle(300, probe_every(10.0, sinks_ok))
        reports = verify(s, expected)
        settled = settled and all(r.ok for r in reports.values())
        phases["settled_s"] = round(time.monotonic() - started, 1)
    except BaseException:
        if disk is not None:
            disk.unmount()
        raise
    finally:
        sampler.stop()
        chaos.cluster.stop_all()
        if net is not None:
            net.stop()
    after_stop = verify(s, expected)
    if disk is not None:
        disk.unmount()  # the files sink's data goes with it: the checks above have read it
    # A soak judges only processes that lived long enough (min_span_s), a short run none.
    growth = sampler.report(min_span_s=SOAK_JUDGE_S if args.soak else math.inf)
    control = control_summary(s)
    sinks = {k: {**_counts(r), "rows": r.rows, "distinct": r.distinct} for k, r in reports.items()}
    failures = [
        f"{k}: {what} = {n}"
        for k, v in sinks.items()
        for what, n in v.items()
        if what not in ("rows", "distinct") and n
    ]
    if not caught_up:
        failures.append("the group's committed offsets never reached the end offsets")
    elif not settled:
        failures.append("the sinks never settled")
    if source_dups:
        failures.append(f"{source_dups} source records repeat an id (producer problem)")
    if chaos.unexpected:
        names = ", ".join(f"{u['target']} rc={u['rc']} at {u['t']}s" for u in chaos.unexpected)
        failures.append(f"{len(chaos.unexpected)} unexpected process exits: {names}")
    ours = [leak for leak in growth["leaks"] if not leak.startswith("stack:")]
    if ours:
        failures.append(f"memory or descriptors grew: {'; '.join(ours)}")
    recov = [
        e["recovery_s"]
        for e in chaos.episodes
        if not e.get("stack") and not e.get("net") and not e.get("store")
    ]
    net_recov = [e["recovery_s"] for e in chaos.episodes if e.get("net") and "recovery_s" in e]
    store_recov = [e["recovery_s"] for e in chaos.episodes if e.get("store")]
    commits = sorted(chaos.commit_times)
    gaps = [b - a for a, b in itertools.pairwise(commits)]
    return {
        "ok": not failures,
        "faults": len(chaos.faults),
        "records": len(expected),
        "sinks": sinks,
        "failures": failures,
        "fault_mix": _mix(chaos.faults),
        "network_faults": len(chaos.net_faults),
        "network_fault_mix": dict(
            sorted(
                collections.Counter(
                    f"{f['role']}:{f['how']}:{f['service']}" for f in chaos.net_faults
                ).items()
            )
        ),
        "fault_kinds": _kinds(chaos),
        "store_faults": sum(1 for f in chaos.store_faults if "not_made" not in f),
        "store_faults_not_made": [f for f in chaos.store_faults if "not_made" in f],
        "disk_full_unavailable": disk_refused or None,
        "kafka_links_faulted": bool(net and net.kafka),
        "stack_restarts": [e["stack"] for e in chaos.episodes if e.get("stack")],
        "unexpected_exits": chaos.unexpected,
        "episodes": len(chaos.episodes),
        "episode_recovery_s": {
            "median": statistics.median(recov) if recov else None,
            "max": max(recov) if recov else None,
            "not_recovered_in_bound": sum(
                1
                for e in chaos.episodes
                if e.get("not_recovered") and not e.get("net") and not e.get("store")
            ),
            # From the heal of the link (kills: from the episode's start).
            "network": {
                "median": statistics.median(net_recov) if net_recov else None,
                "max": max(net_recov) if net_recov else None,
                "not_recovered_in_bound": sum(
                    1 for e in chaos.episodes if e.get("not_recovered") and e.get("net")
                ),
            },
            # From the fault's end (sessions ended; the server or the disk given room).
            "store": {
                "median": statistics.median(store_recov) if store_recov else None,
                "max": max(store_recov) if store_recov else None,
                "not_recovered_in_bound": sum(
                    1 for e in chaos.episodes if e.get("not_recovered") and e.get("store")
                ),
            },
        },
        "longest_commit_gap_s": round(max(gaps), 1) if gaps else None,
        "offsets_caught_up": caught_up,
        "after_stop": {k: _counts(r) for k, r in after_stop.items()},
        "control": control,
        "mode": "soak" if args.soak else "short" if args.short else "full",
        "soak_minutes": args.soak or None,
        "rate_per_s": args.rate if args.soak else None,
        "growth": growth,
        "spared_from_kills": sorted(chaos.spared),
        "seed": args.seed,
        "pipeline": s.name,
        "participants": 3,
        "coordinators": 2,
        "partitions": s.partitions,
        "phases_s": phases,
        "wall_time_s": round(time.monotonic() - started, 1),
        "workdir": str(workdir),
        "episode_log": chaos.episodes,
        "fault_log": chaos.faults,
        "network_fault_log": chaos.net_faults,
        "store_fault_log": chaos.store_faults,
    }


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chaos.run", description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, help="default 200000 (20000 with --short)")
    ap.add_argument("--faults", type=int, default=52, help="kill -9 faults, at least (default 52)")
    ap.add_argument("--seed", type=int, help="fault plan seed (default: random)")
    ap.add_argument("--short", action="store_true", help="4 faults on 20k records (make test)")
    ap.add_argument("--settle", type=float, help="bound on the final catch-up, seconds")
    ap.add_argument(
        "--net-faults",
        type=int,
        help="network fault episodes (Toxiproxy), default 10 (2 with --short)",
    )
    ap.add_argument("--no-net", action="store_true", help="no network faults (kills only)")
    ap.add_argument(
        "--store-faults",
        type=int,
        help="store fault episodes (PostgreSQL sessions ended while a part is prepared, "
        "its connection limit exhausted, the files sink's disk full), default 3 (0 with --short)",
    )
    ap.add_argument(
        "--soak",
        type=float,
        default=0.0,
        metavar="MINUTES",
        help="a soak: records at --rate for this long, a random fault of any kind every "
        "30-120 s, memory and descriptors of every process sampled and judged for growth",
    )
    ap.add_argument("--rate", type=float, default=2000.0, help="records/s of a soak (default 2000)")
    ap.add_argument(
        "--mongo",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a MongoDB sink beside PostgreSQL and files (default: yes, but not in a soak: "
        "SecantusDB, the stack's test server, takes ~1-2k documents/s)",
    )
    ap.add_argument(
        "--print-listeners",
        action="store_true",
        help="print the TWOPHASE_KAFKA_EXTRA_LISTENERS a stack needs for Kafka's proxies and exit",
    )
    ap.add_argument("--workdir", default="", help="default chaos/results/<pipeline>")
    ap.add_argument("--out", default=str(RESULTS / "latest.json"))
    args = ap.parse_args(argv)
    if args.print_listeners:
        # Before `stack.sh up`: the port it will use (its default is 9092).
        print(kafka_listeners(int(os.environ.get("TWOPHASE_KAFKA_PORT", "9092"))))
        return 0
    if args.records is None:
        args.records = 20_000 if args.short else 200_000
    if args.mongo is None:
        args.mongo = not args.soak
    if args.no_net:
        args.net_faults = 0
    elif args.net_faults is None:
        args.net_faults = 2 if args.short else 10
    if args.store_faults is None:
        args.store_faults = 0 if args.short else 3
    if args.settle is None:
        args.settle = 240.0 if args.short else 600.0
    if args.seed is None:
        args.seed = random.randrange(1_000_000)
    # Processes are cleaned up on SIGTERM too (and on SIGINT when it is not ignored).
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        summary = run(args)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    text = json.dumps(summary, indent=2)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)
    log(f"{'OK' if summary['ok'] else 'FAILED'}: {summary['faults']} kills, summary in {out}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
