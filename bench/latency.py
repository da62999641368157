"""Commit latency per cycle, by participant count, at the default 1 s commit interval.

For each count N: one coordinator and N ``twophase participant run`` processes on one pipeline
(a 16-partition source topic, PostgreSQL + files sinks), with a steady trickle of records
produced throughout so every cycle prepares real parts. Once a committed DECISION names all N
participants (the group has settled), the next ``WARMUP_CYCLES`` cycles are timed and reported
apart (``warmup_ms``), and the ``cycles`` after them are measured:

    latency = DECISION.ts_ms - PREPARE.ts_ms      (both stamped by the coordinator)

i.e. from the coordinator asking to the commit point: every participant cut its part, prepared
it durably in both sinks, and voted, and the coordinator wrote the decision in a Kafka
transaction. Aborted cycles count too, as their time to the abort decision (there should be
none once settled; the count, warm-up included, is reported).

Why a warm-up cycle: the group usually settles in the pipeline's first cycle (each
participant's part named, empty: it starts as the coordinator takes the lead), so the cycle
after it is the first whose parts hold records -- the ones produced while the processes started -- and the sinks'
first writes and prepares; with many participants their start-up still runs on the same cores.
On the 2-core machine (2026-11-28, 3 runs each) it took 45-86 ms at 1 participant, whose 20
cycles after it had a p99 of 16-20 ms, and 151-157 ms at 8 (p99 after it 50-54 ms; in one run
the files sink's first flush alone took 24-102 ms across the eight, 2-8 ms in the next cycles).
With 20 measured cycles the p99 is the slowest cycle, so without the warm-up the figure was
that one start-up cycle, not the pipeline's steady commit latency.

Where a cycle's time goes, from the stamps of the control messages themselves (every envelope
carries its sender's clock; all processes share this machine's) and the moment this reader, a
``read_committed`` consumer like the participants, sees the DECISION -- p50 and p99 per phase
in ``phases_ms``:

* ``prepare_to_first_vote`` / ``prepare_to_last_vote``: the PREPARE delivered to the participants,
  their parts cut and prepared in every sink, the votes stamped (the slowest participant sets
  the second);
* ``last_vote_to_decision``: the last VOTE delivered to the coordinator and the decision made;
* ``decision_to_visible``: the DECISION's Kafka transaction committed and delivered to a
  ``read_committed`` consumer -- what the participants wait for before applying.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from bench.throughput import Source, _cleanup, running, scenario
from harness import record
from twophase.config import load_config
from twophase.kafka import create_topics
from twophase.protocol.codec import DecodeError, decode
from twophase.protocol.messages import Decision, Outcome, Prepare, Vote

PARTITIONS = 16
#: Records per second produced while measuring: enough that every part holds data.
TRICKLE_PER_S = 2000
#: Cycles after the group settled that are timed but not measured (the module's docstring).
WARMUP_CYCLES = 1


PHASES = (
    "prepare_to_first_vote",
    "prepare_to_last_vote",
    "last_vote_to_decision",
    "decision_to_visible",
)


def pct(xs: list[int], q: float) -> int:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


@dataclass
class LatencyRun:
    participants: int
    cycles: list[int]
    aborted: int
    settle_s: float
    #: Per phase (PHASES), its milliseconds in each measured cycle.
    phases: dict[str, list[int]] = field(default_factory=dict)
    #: The warm-up cycles' latencies (ms), in order: reported, not measured.
    warmup: list[int] = field(default_factory=list)
    #: The transactions of the measured cycles and of the warm-up ones, in order.
    txns: list[int] = field(default_factory=list)
    warmup_txns: list[int] = field(default_factory=list)

    def pct(self, q: float) -> int:
        return pct(self.cycles, q)

    def asdict(self) -> dict[str, Any]:
        return {
            "participants": self.participants,
            "cycles": len(self.cycles),
            "aborted": self.aborted,
            "p50": self.pct(0.5),
            "p99": self.pct(0.99),
            "max": max(self.cycles),
            "settle_s": round(self.settle_s, 1),
            "warmup_ms": self.warmup,
            "phases_ms": {
                k: {"p50": pct(v, 0.5), "p99": pct(v, 0.99)} for k, v in self.phases.items() if v
            },
        }


class Trickle(threading.Thread):
    """Produces ~``rate`` records per second until stopped."""

    def __init__(self, bootstrap: str, topic: str, rate: int) -> None:
        super().__init__(daemon=True)
        self.p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
        self.topic, self.rate = topic, rate
        self.stop = threading.Event()

    def run(self) -> None:
        import random

        rng = random.Random(1)
        i = 0
        tick = 0.05
        per_tick = max(1, int(self.rate * tick))
        while not self.stop.is_set():
            started = time.monotonic()
            for _ in range(per_tick):
                self.p.produce(self.topic, key=str(i).encode(), value=record(i, rng))
                i += 1
            self.p.poll(0)
            time.sleep(max(0.0, tick - (time.monotonic() - started)))
        self.p.flush(10)


class ControlTail:
    """Follows a pipeline's control topic and pairs each PREPARE with its DECISION."""

    def __init__(self, bootstrap: str, topic: str, reply_topic: str, hmac_key: str) -> None:
        self.c = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"bench-latency-{uuid.uuid4().hex[:6]}",
                "isolation.level": "read_committed",
                "enable.partition.eof": False,
            }
        )
        # The votes are on the reply topic (the DECISION can be read before the last of them:
        # a cycle's phases are taken once its DECISION is read, from what was read by then).
        self.c.assign([TopicPartition(topic, 0, 0), TopicPartition(reply_topic, 0, 0)])
        self.key = hmac_key.encode()
        self.prepared_at: dict[int, int] = {}
        #: Per txn: the stamps of its votes.
        self.votes_at: dict[int, list[int]] = {}

    def next_decision(self, timeout_s: float) -> tuple[Decision, int, dict[str, int]] | None:
        """The next DECISION, its latency in ms and its cycle's phases (ms), or None at the
        timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = self.c.poll(0.2)
            if m is None:
                continue
            err = m.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    raise RuntimeError(f"control topic: {err}")
                continue
            raw = m.headers()
            headers = (
                [(k, v) for k, v in raw if isinstance(v, bytes)] if isinstance(raw, list) else []
            )
            try:
                env = decode(m.value(), headers, key=self.key)
            except DecodeError:
                continue
            p = env.payload
            seen_ms = int(time.time() * 1000)
            if isinstance(p, Prepare):
                self.prepared_at[p.txn] = env.ts_ms
            elif isinstance(p, Vote):
                self.votes_at.setdefault(p.txn, []).append(env.ts_ms)
            elif isinstance(p, Decision) and p.txn in self.prepared_at:
                prepared = self.prepared_at.pop(p.txn)
                votes = self.votes_at.pop(p.txn, [])
                phases = {"decision_to_visible": seen_ms - env.ts_ms}
                if votes:
                    phases |= {
                        "prepare_to_first_vote": min(votes) - prepared,
                        "prepare_to_last_vote": max(votes) - prepared,
                        "last_vote_to_decision": env.ts_ms - max(votes),
                    }
                return p, env.ts_ms - prepared, phases
        return None

    def close(self) -> None:
        self.c.close()


def latency_run(
    bootstrap: str, workdir: Path, participants: int, *, cycles: int = 20, settle_s: float = 120
) -> LatencyRun:
    source = Source.create(bootstrap, 0, f"lat{participants}", PARTITIONS)
    name = f"bench-lat{participants}-{uuid.uuid4().hex[:6]}"
    s = scenario(name, workdir / name, source, sinks={"pg", "files"}, mode="exactly_once")
    cfg = load_config(s.write())
    create_topics(cfg)
    s.prepare_stores()
    trickle = Trickle(bootstrap, source.topic, TRICKLE_PER_S)
    tail = ControlTail(bootstrap, cfg.control_topic, cfg.reply_topic, s.hmac_key)
    started = time.monotonic()
    try:
        trickle.start()
        with running(s, "exactly_once", participants) as (cluster, _ports):
            settled_at = 0.0
            got: list[int] = []
            warmup: list[int] = []
            txns: list[int] = []
            warmup_txns: list[int] = []
            phases: dict[str, list[int]] = {k: [] for k in PHASES}
            aborted = 0
            while len(got) < cycles:
                left = started + settle_s - time.monotonic() if not settled_at else 30.0
                nxt = tail.next_decision(max(1.0, left))
                dead = [n for n in cluster.procs if not cluster.alive(n)]
                if dead:
                    raise RuntimeError(f"{dead[0]} exited:\n{cluster.log_tail(dead[0])}")
                if nxt is None:
                    phase = "measuring" if settled_at else "settling"
                    raise TimeoutError(f"{name}: no decision while {phase}")
                decision, ms, cycle = nxt
                if not settled_at:
                    if decision.outcome is Outcome.COMMIT and len(decision.parts) == participants:
                        settled_at = time.monotonic()
                    continue
                aborted += decision.outcome is not Outcome.COMMIT
                if len(warmup) < WARMUP_CYCLES:
                    warmup.append(ms)
                    warmup_txns.append(decision.txn)
                    continue
                got.append(ms)
                txns.append(decision.txn)
                for k, v in cycle.items():
                    phases[k].append(v)
    finally:
        trickle.stop.set()
        trickle.join(15)
        tail.close()
    _cleanup(s, {"pg", "files"})
    source.delete()
    return LatencyRun(
        participants, got, aborted, settled_at - started, phases, warmup, txns, warmup_txns
    )


def summarize(runs: list[LatencyRun]) -> dict[str, Any]:
    return {
        "p50": round(statistics.median(r.pct(0.5) for r in runs)),
        "p99": round(statistics.median(r.pct(0.99) for r in runs)),
        # Medians over the runs of each phase's p50 / p99.
        "phases_ms": {
            k: {
                q: round(statistics.median(pct(r.phases[k], f) for r in runs))
                for q, f in (("p50", 0.5), ("p99", 0.99))
            }
            for k in PHASES
            if all(r.phases.get(k) for r in runs)
        },
        "runs": [r.asdict() for r in runs],
    }
