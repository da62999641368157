"""Each transition of the coordinator's state machine, event by event."""

from __future__ import annotations

from twophase.coordinator.machine import (
    Alarm,
    CaughtUp,
    CoordinatorMachine,
    CoordinatorSettings,
    LeadershipAcquired,
    LeadershipLost,
    Phase,
    Publish,
    Published,
    PublishFailed,
    Received,
    SourcePartitions,
    StepDown,
    Tick,
)
from twophase.protocol.messages import (
    Applied,
    Checkpoint,
    Complete,
    Decision,
    Drained,
    Envelope,
    Outcome,
    Part,
    PartitionRange,
    Payload,
    Position,
    Prepare,
    Vote,
    VoteValue,
)

T = "src"
TPS = frozenset({(T, 0), (T, 1)})
SETTINGS = CoordinatorSettings(
    commit_interval_ms=100, vote_timeout_ms=1000, max_failed_cycles=2, checkpoint_every=3
)


def env(payload: Payload) -> Envelope:
    return Envelope("id", "pipe", "test", 0, payload)


def published(actions: list[object]) -> list[Payload]:
    return [a.payload for a in actions if isinstance(a, Publish)]


def vote(
    txn: int,
    who: str,
    gen: int = 1,
    ranges: tuple[tuple[int, int, int], ...] = (),
    value: VoteValue = VoteValue.PREPARED,
) -> Vote:
    return Vote(
        txn,
        who,
        gen,
        f"{who}-m",
        value,
        tuple(PartitionRange(T, p, s, e, e - s) for p, s, e in ranges),
        ("pg",) if any(e > s for _, s, e in ranges) else (),
    )


def leader(offsets: dict[tuple[str, int], int] | None = None) -> CoordinatorMachine:
    m = CoordinatorMachine(SETTINGS)
    m.handle(SourcePartitions(TPS, offsets or {(T, 0): 0, (T, 1): 0}))
    m.handle(LeadershipAcquired(0))
    m.handle(CaughtUp(0))
    assert m.phase is Phase.IDLE
    return m


def publish_ok(m: CoordinatorMachine, actions: list[object], now: int) -> list[object]:
    """Answer every Publish with Published, as the adapter does; return all actions."""
    out = list(actions)
    queue = published(actions)
    while queue:
        more = m.handle(Published(queue.pop(0), now))
        out += more
        queue += published(more)
    return out


def start_cycle(m: CoordinatorMachine, now: int = 0) -> int:
    acts = m.handle(Tick(now))
    (prep,) = published(acts)
    assert isinstance(prep, Prepare)
    publish_ok(m, acts, now)
    assert m.phase is Phase.COLLECTING
    return prep.txn


def test_standby_ignores_everything_but_the_partition_set() -> None:
    m = CoordinatorMachine(SETTINGS)
    assert m.handle(Tick(10_000)) == []
    assert m.handle(Received(env(vote(1, "a")), 0)) == []
    assert not m.is_leader


def test_commit_when_one_generation_covers_every_partition_from_the_committed_position() -> None:
    m = leader({(T, 0): 5, (T, 1): 0})
    txn = start_cycle(m)
    assert txn == 1
    assert m.handle(Received(env(vote(1, "a", ranges=((0, 5, 9),))), 1)) == []
    assert m.handle(Received(env(vote(1, "idle")), 1)) == []
    acts = m.handle(Received(env(vote(1, "b", ranges=((1, 0, 0),))), 2))
    (d,) = published(acts)
    assert isinstance(d, Decision) and d.outcome is Outcome.COMMIT
    assert [p.participant for p in d.parts] == ["a", "b", "idle"]
    assert {(p.partition, p.offset) for p in d.positions} == {(0, 9), (1, 0)}
    publish_ok(m, acts, 3)
    assert m.phase is Phase.IDLE and m.committed == 1


def test_votes_of_two_generations_abort() -> None:
    m = leader()
    start_cycle(m)
    m.handle(Received(env(vote(1, "a", gen=1, ranges=((0, 0, 1),))), 1))
    (d,) = published(m.handle(Received(env(vote(1, "b", gen=2, ranges=((1, 0, 1),))), 1)))
    assert isinstance(d, Decision) and d.outcome is Outcome.ABORT and "generations" in d.reason


def test_a_partition_claimed_twice_aborts() -> None:
    m = leader()
    start_cycle(m)
    m.handle(Received(env(vote(1, "a", ranges=((0, 0, 1),))), 1))
    (d,) = published(m.handle(Received(env(vote(1, "b", ranges=((0, 0, 2),))), 1)))
    assert isinstance(d, Decision) and d.outcome is Outcome.ABORT and "claimed by" in d.reason


def test_a_range_not_starting_at_the_committed_position_aborts() -> None:
    m = leader({(T, 0): 3, (T, 1): 0})
    start_cycle(m)
    (d,) = published(m.handle(Received(env(vote(1, "a", ranges=((0, 4, 6),))), 1)))
    assert (
        isinstance(d, Decision) and d.outcome is Outcome.ABORT and "committed position" in d.reason
    )


def test_an_abort_vote_aborts_and_a_duplicate_vote_is_ignored() -> None:
    m = leader()
    start_cycle(m)
    v = vote(1, "a", ranges=((0, 0, 1),))
    m.handle(Received(env(v), 1))
    assert m.handle(Received(env(v), 1)) == []  # the same vote delivered twice
    (d,) = published(m.handle(Received(env(vote(1, "b", value=VoteValue.ABORT)), 1)))
    assert isinstance(d, Decision) and d.outcome is Outcome.ABORT and "voted abort" in d.reason


def test_a_second_different_vote_aborts() -> None:
    m = leader()
    start_cycle(m)
    m.handle(Received(env(vote(1, "a", ranges=((0, 0, 1),))), 1))
    (d,) = published(m.handle(Received(env(vote(1, "a", ranges=((0, 0, 2),))), 1)))
    assert isinstance(d, Decision) and d.outcome is Outcome.ABORT and "twice" in d.reason


def test_votes_for_another_transaction_are_ignored() -> None:
    m = leader()
    start_cycle(m)
    assert m.handle(Received(env(vote(7, "a", ranges=((0, 0, 1), (1, 0, 1)))), 1)) == []
    assert m.phase is Phase.COLLECTING


def test_vote_timeout_aborts_and_names_what_is_missing() -> None:
    m = leader()
    start_cycle(m, now=0)
    m.handle(Received(env(vote(1, "a", ranges=((0, 0, 1),))), 1))
    assert m.handle(Tick(999)) == []
    (d,) = published(m.handle(Tick(1000)))
    assert isinstance(d, Decision) and d.outcome is Outcome.ABORT
    assert "src[1]" in d.reason and "timeout" in d.reason


def test_repeated_aborts_raise_the_alarm_and_a_commit_clears_it() -> None:
    m = leader()
    alarms: list[Alarm] = []
    now = 0
    for _ in range(SETTINGS.max_failed_cycles):
        txn = start_cycle(m, now)
        acts = m.handle(Received(env(vote(txn, "a", value=VoteValue.ABORT)), now))
        alarms += [a for a in publish_ok(m, acts, now) if isinstance(a, Alarm)]
        now += SETTINGS.commit_interval_ms
    assert [a.active for a in alarms] == [True] and alarms[0].failed_cycles == 2
    txn = start_cycle(m, now)
    acts = m.handle(Received(env(vote(txn, "a", ranges=((0, 0, 0), (1, 0, 0)))), now))
    cleared = [a for a in publish_ok(m, acts, now) if isinstance(a, Alarm)]
    assert [a.active for a in cleared] == [False]


def test_failover_presumes_abort_of_an_undecided_prepare() -> None:
    m = CoordinatorMachine(SETTINGS)
    m.handle(SourcePartitions(TPS, {}))
    m.handle(LeadershipAcquired(0))
    assert m.phase is Phase.RECOVERING
    for msg in (Prepare(1, 0), Decision(1, Outcome.ABORT, reason="x"), Prepare(2, 0)):
        assert m.handle(Received(env(msg), 0)) == []
    (d,) = published(m.handle(CaughtUp(0)))
    assert d == Decision(2, Outcome.ABORT, reason="presumed abort after coordinator failover")
    publish_ok(m, [Publish(d)], 1)
    assert m.phase is Phase.IDLE
    (p,) = published(m.handle(Tick(1000)))
    assert isinstance(p, Prepare) and p.txn == 3


def test_fenced_write_steps_down_and_nothing_more_is_published() -> None:
    m = leader()
    acts = m.handle(Tick(0))
    (prep,) = published(acts)
    out = m.handle(PublishFailed(prep, 0, "fenced", fenced=True))
    assert any(isinstance(a, StepDown) for a in out)
    assert m.phase is Phase.STANDBY and m.handle(Tick(10_000)) == []


def test_leadership_lost_steps_down() -> None:
    m = leader()
    assert any(isinstance(a, StepDown) for a in m.handle(LeadershipLost(0, "lease")))
    assert m.handle(Tick(10_000)) == []


def test_a_prepare_that_failed_to_land_is_decided_abort() -> None:
    m = leader()
    (prep,) = published(m.handle(Tick(0)))
    (d,) = published(m.handle(PublishFailed(prep, 0, "broker timeout")))
    assert isinstance(d, Decision) and d.txn == prep.txn and d.outcome is Outcome.ABORT


def test_a_decision_that_failed_to_land_is_published_again_unchanged() -> None:
    m = leader()
    txn = start_cycle(m)
    (d,) = published(m.handle(Received(env(vote(txn, "a", value=VoteValue.ABORT)), 0)))
    m.handle(PublishFailed(d, 0, "broker timeout"))
    assert m.phase is Phase.DECIDING
    assert published(m.handle(Tick(SETTINGS.publish_retry_ms - 1))) == []
    assert published(m.handle(Tick(SETTINGS.publish_retry_ms))) == [d]


def test_complete_once_every_part_is_applied_and_checkpoints_every_n_decisions() -> None:
    m = leader()
    seen: list[Payload] = []
    now = 0
    for _ in range(SETTINGS.checkpoint_every):
        txn = start_cycle(m, now)
        acts = m.handle(Received(env(vote(txn, "a", ranges=((0, 0, 0), (1, 0, 0)))), now))
        seen += published(publish_ok(m, acts, now))
        seen += published(publish_ok(m, m.handle(Received(env(Applied(txn, "a", "a")), now)), now))
        now += SETTINGS.commit_interval_ms
    completes = [p.txn for p in seen if isinstance(p, Complete)]
    assert completes == [1, 2, 3]
    (cp,) = [p for p in seen if isinstance(p, Checkpoint)]
    assert cp.last_txn == 3 and cp.positions == (Position(T, 0, 0), Position(T, 1, 0))
    assert [p.txn for p in cp.pending] == [3]  # txn 3 was still waiting for its APPLIED
    assert Part("a", 1, ()) in cp.pending[0].parts


def test_a_later_generation_vote_replaces_an_idle_one_and_the_cycle_commits() -> None:
    m = leader()
    start_cycle(m)
    assert m.handle(Received(env(vote(1, "late", gen=-1)), 1)) == []  # voted before it held any
    m.handle(Received(env(vote(1, "a", gen=4, ranges=((0, 0, 3),))), 1))
    acts = m.handle(Received(env(vote(1, "late", gen=4, ranges=((1, 0, 0),))), 2))
    (d,) = published(acts)
    assert isinstance(d, Decision) and d.outcome is Outcome.COMMIT, d
    assert {(p.participant, p.generation) for p in d.parts} == {("a", 4), ("late", 4)}


def test_a_second_vote_replacing_a_busy_one_aborts() -> None:
    m = leader()
    start_cycle(m)
    m.handle(Received(env(vote(1, "a", gen=1, ranges=((0, 0, 1),))), 1))
    (d,) = published(m.handle(Received(env(vote(1, "a", gen=2, ranges=((0, 0, 2),))), 1)))
    assert isinstance(d, Decision) and d.outcome is Outcome.ABORT and "twice" in d.reason


# -- topics that come and go (sources[].topic_pattern): votes say which topics they read --------

NEW = "src.new"


def topic_vote(
    txn: int, who: str, topics: tuple[str, ...], ranges: tuple[tuple[str, int, int, int], ...]
) -> Vote:
    return Vote(
        txn,
        who,
        1,
        f"{who}-m",
        VoteValue.PREPARED,
        tuple(PartitionRange(t, p, s, e, e - s) for t, p, s, e in ranges),
        ("pg",),
        topics=topics,
    )


def test_a_topic_no_voter_reads_yet_does_not_hold_back_the_commit() -> None:
    """The coordinator's metadata shows a new topic before the participants subscribe to it:
    votes covering every partition of the topics they read commit; the new topic's positions
    stay unknown (nothing of it was read)."""
    m = leader()
    m.handle(SourcePartitions(TPS | {(NEW, 0)}, {(T, 0): 0, (T, 1): 0}))
    start_cycle(m)
    assert m.handle(Received(env(topic_vote(1, "a", (T,), ((T, 0, 0, 4),))), 1)) == []
    (d,) = published(m.handle(Received(env(topic_vote(1, "b", (T,), ((T, 1, 0, 2),))), 2)))
    assert isinstance(d, Decision) and d.outcome is Outcome.COMMIT
    assert {(p.topic, p.partition, p.offset) for p in d.positions} == {(T, 0, 4), (T, 1, 2)}


def test_once_a_voter_reads_the_new_topic_every_partition_of_it_must_be_covered() -> None:
    m = leader()
    m.handle(SourcePartitions(TPS | {(NEW, 0), (NEW, 1)}, {(T, 0): 0, (T, 1): 0}))
    start_cycle(m)
    both = (T, NEW)
    m.handle(Received(env(topic_vote(1, "a", both, ((T, 0, 0, 4), (NEW, 0, 0, 3)))), 1))
    # b still reads only T (its assignment predates the new topic): NEW[1] is nobody's yet
    assert m.handle(Received(env(topic_vote(1, "b", (T,), ((T, 1, 0, 2),))), 2)) == []
    (d,) = published(m.handle(Tick(SETTINGS.vote_timeout_ms)))
    assert isinstance(d, Decision) and d.outcome is Outcome.ABORT
    assert f"{NEW}[1]" in d.reason


def test_a_vote_naming_partitions_the_metadata_does_not_show_waits_for_the_refresh() -> None:
    """A participant subscribed to a topic the coordinator has not seen yet: the cycle waits,
    and commits once the metadata shows it -- or aborts at the deadline, naming it."""
    m = leader()
    start_cycle(m)
    both = (T, NEW)
    m.handle(Received(env(topic_vote(1, "a", both, ((T, 0, 0, 4), (NEW, 0, 0, 3)))), 1))
    assert m.handle(Received(env(topic_vote(1, "b", both, ((T, 1, 0, 2),))), 2)) == []
    m.handle(SourcePartitions(TPS | {(NEW, 0)}, {(T, 0): 0, (T, 1): 0}))
    (d,) = published(m.handle(Tick(3)))  # the next tick re-evaluates the cycle
    assert isinstance(d, Decision) and d.outcome is Outcome.COMMIT, d
    assert (NEW, 0, 3) in {(p.topic, p.partition, p.offset) for p in d.positions}

    m2 = leader()
    start_cycle(m2)
    m2.handle(Received(env(topic_vote(1, "a", both, ((T, 0, 0, 4), (NEW, 0, 0, 3)))), 1))
    m2.handle(Received(env(topic_vote(1, "b", both, ((T, 1, 0, 2),))), 2))
    (d,) = published(m2.handle(Tick(SETTINGS.vote_timeout_ms)))
    assert isinstance(d, Decision) and d.outcome is Outcome.ABORT
    assert f"{NEW}[0]" in d.reason and "metadata does not show" in d.reason


def test_a_vote_without_topics_needs_every_source_partition_as_before() -> None:
    m = leader()
    m.handle(SourcePartitions(TPS | {(NEW, 0)}, {(T, 0): 0, (T, 1): 0}))
    start_cycle(m)
    m.handle(Received(env(vote(1, "a", ranges=((0, 0, 4),))), 1))
    assert m.handle(Received(env(vote(1, "b", ranges=((1, 0, 2),))), 2)) == []
    (d,) = published(m.handle(Tick(SETTINGS.vote_timeout_ms)))
    assert isinstance(d, Decision) and d.outcome is Outcome.ABORT and f"{NEW}[0]" in d.reason


# -- DRAINED: a cycle started before the interval ----------------------------------------------

EARLY = CoordinatorSettings(
    commit_interval_ms=1000, vote_timeout_ms=5000, max_failed_cycles=2, early_min_records=100
)


def committed_once(settings: CoordinatorSettings = EARLY) -> CoordinatorMachine:
    """A leader whose txn 1 committed at t=10: the next cycle is due at t=1000."""
    m = CoordinatorMachine(settings)
    m.handle(SourcePartitions(TPS, {(T, 0): 0, (T, 1): 0}))
    m.handle(LeadershipAcquired(0))
    m.handle(CaughtUp(0))
    assert start_cycle(m) == 1
    m.handle(Received(env(vote(1, "a", ranges=((0, 0, 5),))), 5))
    publish_ok(m, m.handle(Received(env(vote(1, "b", ranges=((1, 0, 5),))), 10)), 10)
    assert m.phase is Phase.IDLE and m.committed == 1 and m.next_cycle_ms == 1000
    return m


def drained(who: str, after: int, records: int, *partitions: int) -> Envelope:
    positions = tuple(Position(T, p, 500) for p in partitions)
    return env(Drained(after, who, 1, positions, records))


def test_drained_hints_covering_every_partition_start_the_next_cycle_at_once() -> None:
    m = committed_once()
    assert published(m.handle(Received(drained("a", 1, 80, 0), 50))) == []
    assert m.handle(Tick(60)) == []  # one partition is not covered yet
    acts = m.handle(Received(drained("b", 1, 40, 1), 70))
    (prep,) = published(acts)
    assert isinstance(prep, Prepare) and prep.txn == 2 and m.early_cycles == 1
    publish_ok(m, acts, 70)
    # The normal pace goes on from the early start; the hints were used up by the PREPARE.
    m.handle(Received(env(vote(2, "a", ranges=((0, 5, 9),))), 80))
    publish_ok(m, m.handle(Received(env(vote(2, "b", ranges=((1, 5, 7),))), 90)), 90)
    assert m.phase is Phase.IDLE and m.next_cycle_ms == 1070
    assert m.handle(Tick(100)) == []


def test_hints_that_cannot_start_a_cycle_early() -> None:
    """Too few records, sent before the last PREPARE (stale), or after a failed cycle: the
    cycle waits for its interval."""
    m = committed_once()
    m.handle(Received(drained("a", 1, 50, 0), 50))
    m.handle(Received(drained("b", 1, 49, 1), 50))
    assert m.handle(Tick(60)) == []  # 99 records < 100

    m = committed_once()
    m.handle(Received(drained("a", 0, 500, 0, 1), 50))  # sent before it read PREPARE 1
    assert m.handle(Tick(60)) == []
    m.handle(Received(drained("a", 1, 500, 0), 70))
    m.handle(Received(drained("b", 0, 500, 1), 70))
    assert m.handle(Tick(80)) == []

    m = committed_once()
    acts = m.handle(Tick(1000))
    publish_ok(m, acts, 1000)
    publish_ok(m, m.handle(Received(env(vote(2, "a", value=VoteValue.ABORT)), 1001)), 1001)
    assert m.phase is Phase.IDLE and m.failed_cycles == 1
    m.handle(Received(drained("a", 2, 500, 0, 1), 1010))
    assert m.handle(Tick(1020)) == []
    assert published(m.handle(Tick(2000)))  # the interval still starts it


def test_hints_count_only_when_the_early_start_is_on() -> None:
    m = committed_once(
        CoordinatorSettings(commit_interval_ms=1000, vote_timeout_ms=5000, early_min_records=0)
    )
    m.handle(Received(drained("a", 1, 10**6, 0, 1), 50))
    assert m.handle(Tick(60)) == []


def test_hints_read_while_a_cycle_collects_start_the_next_one_when_it_is_decided() -> None:
    m = committed_once()
    acts = m.handle(Tick(1000))
    publish_ok(m, acts, 1000)
    # Both cut txn 2 and drained again before the decision: their open parts follow txn 2.
    m.handle(Received(drained("a", 2, 300, 0), 1005))
    m.handle(Received(drained("b", 2, 300, 1), 1006))
    m.handle(Received(env(vote(2, "a", ranges=((0, 5, 9),))), 1010))
    acts = publish_ok(m, m.handle(Received(env(vote(2, "b", ranges=((1, 5, 7),))), 1020)), 1020)
    assert m.phase is Phase.IDLE
    (prep,) = published(m.handle(Tick(1021)))
    assert isinstance(prep, Prepare) and prep.txn == 3
