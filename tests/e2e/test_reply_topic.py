"""The reply topic (PROTOCOL.md, "The reply topic") on the real stack: participants send their
votes and APPLIED where the coordinator's messages say, and never read them; a coordinator
without the topic takes them on the control topic and moves to the topic once it is made; a new
leader finds the APPLIED written since the last checkpoint; what does not belong on the reply
topic is skipped and counted by the coordinator alone. Every check reads the topics and the
sinks themselves."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from harness import Cluster, Scenario, produce, verify, wait_until
from tests.e2e.e2e_support import SKIPPED, metric, read_topic, scenario, scrape, settle, start
from twophase.config import PipelineConfig, load_config
from twophase.kafka import create_topics
from twophase.protocol.codec import AUTH_HEADER, _mac, decode, encode, new_envelope
from twophase.protocol.messages import (
    COORDINATOR_MESSAGES,
    Applied,
    Checkpoint,
    Complete,
    Decision,
    Drained,
    Envelope,
    Prepare,
    Vote,
    VoteValue,
)


def _envelopes(s: Scenario, topic: str) -> list[Envelope]:
    out = []
    for m in read_topic(s.bootstrap, topic):
        headers = [(k, v) for k, v in m.headers() or [] if isinstance(v, bytes)]
        out.append(decode(m.value(), headers, key=s.hmac_key.encode()))
    return out


def _replies(envs: list[Envelope]) -> list[Envelope]:
    return [e for e in envs if isinstance(e.payload, Vote | Applied)]


@contextmanager
def _trickle(s: Scenario, start: int, every_s: float = 0.2, batch: int = 20) -> Iterator[list[int]]:
    """Records keep coming (so every cycle has parts to apply); yields the ids produced."""
    produced: list[int] = []
    stop = threading.Event()

    def run() -> None:
        i = start
        while not stop.wait(every_s):
            produce(s.bootstrap, s.topic, i, batch)
            produced.extend(range(i, i + batch))
            i += batch

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield produced
    finally:
        stop.set()
        t.join(30)


def test_votes_and_applied_go_to_the_reply_topic_and_no_participant_reads_them(
    tmp_path: Path,
) -> None:
    s = scenario(tmp_path, "replies", interval_ms=300, mongo=False)
    cfg = load_config(s.config_path)
    n = 2_000
    produce(s.bootstrap, s.topic, 0, n)
    c = Cluster(s)
    start(c, "coordinator", "coord-0")
    start(c, "participant", "p-0")
    start(c, "participant", "p-1")
    try:
        report = settle(s, c, set(range(n)), 90)
        wait_until(
            lambda: any(isinstance(e.payload, Complete) for e in _envelopes(s, cfg.control_topic)),
            30,
            "a COMPLETE",
        )
    finally:
        c.stop_all()
    for sink, r in report.items():
        assert r.ok, f"{sink}: {r}"
    control = _envelopes(s, cfg.control_topic)
    replies = _replies(_envelopes(s, cfg.reply_topic))
    # Every coordinator message names the reply topic; no reply is on the control topic.
    ours = [e for e in control if isinstance(e.payload, COORDINATOR_MESSAGES)]
    assert ours and {e.reply_to for e in ours} == {cfg.reply_topic}
    assert _replies(control) == []
    # Votes of both participants, for cycles prepared, and the APPLIED of every committed part
    # of a completed transaction.
    votes = {(e.payload.txn, e.payload.participant) for e in replies if isinstance(e.payload, Vote)}
    prepared = {e.payload.txn for e in control if isinstance(e.payload, Prepare)}
    committed = [
        e.payload
        for e in control
        if isinstance(e.payload, Decision) and e.payload.outcome.value == "commit"
    ]
    assert {t for t, _ in votes} <= prepared and {p for _, p in votes} == {"p-0", "p-1"}
    applied = {(e.payload.txn, e.payload.part) for e in replies if isinstance(e.payload, Applied)}
    completed = {e.payload.txn for e in control if isinstance(e.payload, Complete)}
    assert completed
    for d in committed:
        if d.txn in completed:
            assert {(d.txn, p.participant) for p in d.parts} <= applied, d


def test_without_the_reply_topic_replies_use_the_control_topic_until_it_is_made(
    tmp_path: Path,
) -> None:
    s = scenario(tmp_path, "noreply", create=False, interval_ms=300, mongo=False)
    cfg = load_config(s.config_path)
    create_topics(cfg, only={cfg.control_topic, cfg.dead_letter_topic, s.topic})
    c = Cluster(s)
    start(c, "coordinator", "coord-0")
    start(c, "participant", "p-0")
    start(c, "participant", "p-1")
    try:
        with _trickle(s, 0) as produced:
            wait_until(
                lambda: len(_replies(_envelopes(s, cfg.control_topic))) >= 10,
                90,
                "votes on the control topic",
            )
            assert "reply topic" in c.log_tail("coord-0", 400)
            create_topics(cfg)  # the operator runs `twophase topics create` again
            # Found with the source topics' metadata (every 10 s).
            wait_until(
                lambda: len(_replies(_envelopes(s, cfg.reply_topic))) >= 10,
                60,
                "votes on the reply topic once it exists",
            )
        report = settle(s, c, set(produced), 90)
    finally:
        c.stop_all()
    for sink, r in report.items():
        assert r.ok, f"{sink}: {r}"
    control = _envelopes(s, cfg.control_topic)
    on_control = {e.payload.txn for e in _replies(control) if isinstance(e.payload, Vote)}
    on_reply = {
        e.payload.txn
        for e in _replies(_envelopes(s, cfg.reply_topic))
        if isinstance(e.payload, Vote)
    }
    # A vote goes where the latest coordinator message its sender read said: before the topic
    # was found, the control topic; after, the reply topic. The cycle prepared just before the
    # first PREPARE naming it may have votes on either (a COMPLETE naming it came between).
    said = {e.payload.txn: e.reply_to for e in control if isinstance(e.payload, Prepare)}
    first = min(t for t, r in said.items() if r == cfg.reply_topic)
    assert all(r == cfg.reply_topic for t, r in said.items() if t > first), said  # it stays
    assert on_control and on_reply
    assert max(on_control) <= first and min(on_reply) >= first - 1, (on_control, on_reply)


def _checkpoints(envs: list[Envelope], cfg: PipelineConfig) -> list[Checkpoint]:
    return [
        e.payload
        for e in envs
        if isinstance(e.payload, Checkpoint) and e.reply_to == cfg.reply_topic
    ]


def test_a_new_leader_reads_the_replies_written_since_the_last_checkpoint(
    tmp_path: Path,
) -> None:
    """The leader dies right after writing a commit DECISION: its participants apply the parts
    and send APPLIED to the reply topic while no coordinator reads it. The standby takes over,
    reads the reply topic from the last checkpoint's ``replies_from`` and so completes the
    transaction with those APPLIED. (Started at the topic's end it would complete it only after
    a checkpoint of its own listed the parts unacknowledged and each participant, at a sweep,
    applied its part again and sent a second APPLIED.)"""
    s = scenario(
        tmp_path,
        "replyfail",
        mongo=False,
        extra={"commit": {"interval_ms": 300, "vote_timeout_ms": 10_000, "checkpoint_every": 2}},
    )
    cfg = load_config(s.config_path)
    c = Cluster(s)
    start(c, "coordinator", "coord-0", {"TWOPHASE_CRASH_AT": "after_decision:7"})
    start(c, "participant", "p-0")
    start(c, "participant", "p-1")
    try:
        with _trickle(s, 0) as produced:
            wait_until(lambda: not c.alive("coord-0"), 90, "coord-0 to die after a decision")
            control = _envelopes(s, cfg.control_topic)
            last = [e.payload for e in control if isinstance(e.payload, Decision)][-1]
            checkpoint = _checkpoints(control, cfg)[-1]
            assert last.outcome.value == "commit" and last.parts, last
            # Its parts are applied and acknowledged while no coordinator leads.
            want = {(last.txn, p.participant) for p in last.parts}

            def acked() -> set[tuple[int, str]]:
                return {
                    (e.payload.txn, e.payload.part)
                    for e in _replies(_envelopes(s, cfg.reply_topic))
                    if isinstance(e.payload, Applied)
                }

            wait_until(lambda: want <= acked(), 30, f"the APPLIED of txn {last.txn}")
            start(c, "coordinator", "coord-1")
            wait_until(
                lambda: any(
                    isinstance(e.payload, Complete)
                    and e.payload.txn == last.txn
                    and e.sender == "coordinator:coord-1"
                    for e in _envelopes(s, cfg.control_topic)
                ),
                60,
                f"coord-1 to complete txn {last.txn}",
            )
        report = settle(s, c, set(produced), 90)
        started = re.findall(
            r"reading replies from \S+ at offset (\d+)", c.log_tail("coord-1", 400)
        )
    finally:
        c.stop_all()
    for sink, r in report.items():
        assert r.ok, f"{sink}: {r}"
    # From the checkpoint's offset: neither the topic's start nor its end. (The participants'
    # producers are not transactional: a reply's offset is its place in the topic.)
    assert started == [str(checkpoint.replies_from)], started
    applied_at = [
        (i, e.payload.part)
        for i, e in enumerate(_envelopes(s, cfg.reply_topic))
        if isinstance(e.payload, Applied) and e.payload.txn == last.txn
    ]
    assert 0 < checkpoint.replies_from <= min(applied_at)[0], (checkpoint, applied_at)
    # One APPLIED a part: the ones sent while no coordinator led were the ones that counted.
    assert sorted(p for _, p in applied_at) == sorted(p for _, p in want), applied_at


def _signed(key: bytes, value: bytes) -> list[tuple[str, bytes]]:
    return [(AUTH_HEADER, _mac(key, value).encode())]


def test_what_does_not_belong_on_the_reply_topic_is_counted_by_the_coordinator_alone(
    tmp_path: Path,
) -> None:
    s = scenario(tmp_path, "replyjunk", interval_ms=300, mongo=False)
    cfg = load_config(s.config_path)
    key = s.hmac_key.encode()
    n = 500
    produce(s.bootstrap, s.topic, 0, n)
    c = Cluster(s)
    cport = start(c, "coordinator", "coord-0")
    pport = start(c, "participant", "p-0")
    try:
        settle(s, c, set(range(n)), 60)
        commits = metric(scrape(cport), "twophase_commit_cycles_total", outcome="commit")

        def signed(payload: Any, pipeline: str = s.name) -> bytes:
            return encode(new_envelope(pipeline, "participant:x", payload), key)[0]

        prepare = signed(Prepare(txn=10_000, deadline_ms=1))
        junk = [
            (prepare, "misplaced"),  # a coordinator's message: nobody's to act on here
            (signed(Drained(after_txn=1, participant="x", generation=1)), "misplaced"),
            (prepare[: len(prepare) // 2], "malformed"),
            (
                signed(
                    Vote(txn=1, participant="x", generation=1, member_id="m", vote=VoteValue.ABORT),
                    "another-pipeline",
                ),
                "foreign_pipeline",
            ),
        ]
        p = Producer({"bootstrap.servers": s.bootstrap, "acks": "all"})
        for value, _kind in junk:
            p.produce(
                cfg.reply_topic, key=s.name.encode(), value=value, headers=_signed(key, value)
            )
        p.produce(cfg.reply_topic, key=s.name.encode(), value=prepare)  # unsigned
        assert p.flush(30) == 0
        expected = {"misplaced": 2, "malformed": 1, "foreign_pipeline": 1, "bad_auth": 1}

        def counted() -> bool:
            text = scrape(cport)
            return all(metric(text, SKIPPED, kind=k) == v for k, v in expected.items())

        wait_until(counted, 30, "the coordinator to count every skipped reply")
        produce(s.bootstrap, s.topic, n, n)
        report = settle(s, c, set(range(2 * n)), 60)
        after = scrape(cport), scrape(pport)
        assert c.alive("coord-0") and c.alive("p-0")
    finally:
        c.stop_all()
    for sink, r in report.items():
        assert r.ok, f"{sink}: {r}"
    assert metric(after[0], "twophase_commit_cycles_total", outcome="commit") > commits
    assert metric(after[1], SKIPPED) == 0  # participants never read the reply topic
    assert all(r.ok for r in verify(s, set(range(2 * n))).values())


def test_a_reply_topic_deleted_while_in_use_is_given_up_and_taken_up_again_when_made(
    tmp_path: Path,
) -> None:
    """The reply topic disappears under a running pipeline: the coordinator stops naming it,
    the participants reply on the control topic again (a cycle whose votes were on their way
    to the deleted topic aborts at its deadline, nothing more), and once the topic is made
    again the coordinator reads it again and the participants use it again. Every record
    exactly once throughout."""
    s = scenario(tmp_path, "replygone", interval_ms=500, mongo=False)
    cfg = load_config(s.config_path)
    admin = AdminClient({"bootstrap.servers": s.bootstrap})
    c = Cluster(s)
    start(c, "coordinator", "coord-0")
    start(c, "participant", "p-0")
    start(c, "participant", "p-1")

    def log() -> str:
        return c.log_tail("coord-0", 100_000)

    def commits_since(line: str) -> int:
        return log().split(line, 1)[-1].count(" committed (")

    try:
        with _trickle(s, 0) as produced:
            wait_until(
                lambda: len(_replies(_envelopes(s, cfg.reply_topic))) >= 10,
                90,
                "votes on the reply topic",
            )
            admin.delete_topics([cfg.reply_topic])[cfg.reply_topic].result(30)
            wait_until(
                lambda: cfg.reply_topic not in admin.list_topics(timeout=10).topics,
                60,
                "the reply topic to be gone",
            )
            # Seen with the source topics' metadata (every 10 s), or by its reader.
            wait_until(lambda: "cannot be read" in log(), 60, "the coordinator to drop it")
            wait_until(
                lambda: commits_since("cannot be read") >= 3,
                60,
                "cycles to commit with the replies on the control topic",
            )
            assert create_topics(cfg)[cfg.reply_topic] == "created"
            wait_until(
                lambda: log().count("reading replies from") >= 2, 60, "the coordinator to read it"
            )
            wait_until(
                lambda: len(_replies(_envelopes(s, cfg.reply_topic))) >= 4,
                60,
                "votes on the reply topic made again",
            )
        report = settle(s, c, set(produced), 90)
    finally:
        c.stop_all()
    for sink, r in report.items():
        assert r.ok, f"{sink}: {r}"
    # Between the two the votes were on the control topic -- from the deletion on (a refused
    # reply goes there) -- and the PREPAREs named no reply topic; after, none is there.
    control = _envelopes(s, cfg.control_topic)
    on_control = {e.payload.txn for e in _replies(control) if isinstance(e.payload, Vote)}
    unnamed = {e.payload.txn for e in control if isinstance(e.payload, Prepare) and not e.reply_to}
    assert on_control and unnamed, (on_control, unnamed)
    assert max(on_control) <= max(unnamed) + 1, (on_control, unnamed)
