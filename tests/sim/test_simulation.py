"""Thousands of random schedules through the real state machines -- the coordinator's and the
participants' (``world``), the Spark driver's (``spark_world``); every one must keep the
guarantees. A failing seed is reported with the one command that replays it with a trace.

``TWOPHASE_SIM_SEED_BASE`` shifts the seed range (to explore new schedules locally); CI keeps
the default so a red run always names seeds anyone can replay.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from . import spark_world, world
from .seeds import assert_seeds_pass

BASE = int(os.environ.get("TWOPHASE_SIM_SEED_BASE", "0"))
#: Each simulator: its module, run(), and its schedules as chunks x seeds per chunk.
SIMULATORS = {
    "coordinator": ("tests.sim.world", world.run, 20, 500),
    "spark": ("tests.sim.spark_world", spark_world.run, 4, 1000),
}
CHUNKS = [
    (name, chunk) for name, (_, _, chunks, _) in SIMULATORS.items() for chunk in range(chunks)
]
#: Codec round trips validate every message against the JSON Schemas: ~10x slower, so fewer.
WIRE_SEEDS = {"coordinator": 100, "spark": 200}
WIRE_BASE = 1_000_000


@pytest.mark.parametrize(("simulator", "chunk"), CHUNKS)
def test_random_schedules(simulator: str, chunk: int) -> None:
    module, run, _, per_chunk = SIMULATORS[simulator]
    assert_seeds_pass(module, run, range(BASE + chunk * per_chunk, BASE + (chunk + 1) * per_chunk))


@pytest.mark.parametrize("simulator", SIMULATORS)
def test_random_schedules_through_the_codec(simulator: str) -> None:
    """Every message encoded (schema-validated) and decoded again on each delivery."""
    module, run, _, _ = SIMULATORS[simulator]
    start = WIRE_BASE + BASE
    assert_seeds_pass(module, run, range(start, start + WIRE_SEEDS[simulator]), wire=True)


@pytest.mark.parametrize("simulator", SIMULATORS)
def test_a_seed_replays_exactly(simulator: str) -> None:
    """Determinism is what makes a printed seed worth anything."""
    _, run, _, _ = SIMULATORS[simulator]
    a = run(4242, verbose=True)
    b = run(4242, verbose=True)
    assert a.trace == b.trace and len(a.trace) > 100


def test_the_spark_driver_s_faults_happen() -> None:
    """A simulator whose faults never fire proves nothing: across a few hundred schedules each
    kind shows up in the traces."""
    seen = "\n".join(
        line for seed in range(300) for line in spark_world.run(seed, verbose=True).trace
    )
    for what in (
        "CRASHES",
        "becomes a zombie",
        "raises FencedError",
        "raises TwophaseBatchError",
        "raises RetriableError",
        "executor lost",
        "refuses a row",
        "lock wait in pg timed out",
        "is a replay of a committed batch",
        "abort (dead attempt",
        "(decided)",
        "(it landed)",
        "CHECKPOINT",
    ):
        assert what in seen, what


def test_the_network_faults_happen() -> None:
    """Delays and partitions, and what they lead to, show up across a hundred schedules (the
    ones a schedule meets rarely -- a participant that exits on an undeliverable message, a
    prepare given up -- have hand-written scenarios); and a schedule full of them replays
    exactly."""
    seeds: Counter[str] = Counter()
    for seed in range(100):
        w = world.World(seed)
        assert w.run().ok, seed
        seeds.update(w.seen.keys())
    for what in (
        "control message delayed",
        "participant's message delayed",
        "coordinator's write delayed",
        "record delayed",
        "decision ahead of a record produced before it",
        "vote lands after its decision",
        "participant cut off from kafka",
        "participant cut off from store",
        "participant cut off from both",
        "participant dropped by the group",
        "leader cut off from Kafka",
        "leader loses the control partition",
        "coordinator's write blocked",
        "coordinator's write given up",
        "coordinator killed in a write that still lands",
        "begin given up",
        "write given up",
        "abort given up",
        "DRAINED sent",
        "cycle started early",
    ):
        assert seeds[what] >= 1, what
    a, b = world.run(54, verbose=True), world.run(54, verbose=True)
    assert a.trace == b.trace and "cut off from Kafka" in "\n".join(a.trace)


def test_the_reply_topic_is_used() -> None:
    """Across a couple of hundred schedules the reply topic and its variants show up: replies
    land there and are read on either side of the control messages around them; a new leader
    resumes reading at a checkpoint's replies_from and counts an APPLIED written before its
    takeover; a deposed leader still reads replies; the topic is found mid-reign; older
    participants reply on the control topic."""
    seen: Counter[str] = Counter()
    variants: Counter[str] = Counter()
    for seed in range(200):
        w = world.World(seed)
        assert w.run().ok, seed
        seen.update(w.seen.keys())
        at = w.p.reply_topic_at
        variants["from the start" if at == 0 else "never" if at < 0 else "mid-run"] += 1
        variants["old participants"] += bool(w.p.old_participants)
        variants["old coordinator"] += w.p.old_coordinator
    assert variants["from the start"] > 100 and min(variants.values()) >= 10, variants
    for what in (
        "VOTE on the reply topic",
        "APPLIED on the reply topic",
        "own APPLIED folded in on delivery",
        "reply delayed",
        "reply read ahead of a control message written before it",
        "control message read ahead of a reply written before it",
        "leader reads replies from the start",
        "leader reads replies from a checkpoint's replies_from",
        "APPLIED written before a takeover counted by the new leader",
        "deposed leader reads a reply",
        "reply topic found mid-reign",
        "old participant's reply on the control topic",
        "old participant upgraded",
    ):
        assert seen[what] >= 1, what
