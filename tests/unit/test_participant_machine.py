"""Each transition of the participant's state machine, event by event."""

from __future__ import annotations

import pytest

from twophase.participants.machine import (
    AbortPart,
    Action,
    Assigned,
    BeginPart,
    CaughtUp,
    CommitPart,
    Cut,
    InDoubt,
    Log,
    PartApplied,
    ParticipantMachine,
    ParticipantSettings,
    PrepareDone,
    PrepareFailed,
    PreparePart,
    Quiet,
    Received,
    Revoked,
    Seek,
    SendApplied,
    SendDrained,
    SendVote,
    Sweep,
    Thread,
    Tick,
    WillWrite,
    Written,
)
from twophase.protocol.messages import (
    Applied,
    Decision,
    Drained,
    Envelope,
    Outcome,
    Part,
    Payload,
    Position,
    Prepare,
    VoteValue,
)

T = "src"
TP0, TP1 = (T, 0), (T, 1)
SINKS = ("pg", "mongo")


def env(payload: Payload) -> Envelope:
    return Envelope("id", "pipe", "test", 0, payload)


def of(actions: list[Action], kind: type) -> list:  # type: ignore[type-arg]
    return [a for a in actions if isinstance(a, kind)]


def machine(
    offsets: dict[tuple[str, int], int] | None = None, name: str = "a"
) -> ParticipantMachine:
    m = ParticipantMachine(ParticipantSettings(name, SINKS, sweep_interval_ms=1000))
    m.handle(CaughtUp())
    m.handle(InDoubt(()))
    m.handle(Assigned(3, f"{name}-1", offsets if offsets is not None else {TP0: 0, TP1: 10}))
    return m


def commit(txn: int, *parts: Part, pos: dict[tuple[str, int], int]) -> Decision:
    return Decision(
        txn, Outcome.COMMIT, parts, tuple(Position(t, p, o) for (t, p), o in sorted(pos.items()))
    )


def write(m: ParticipantMachine, batch: dict[tuple[str, int], tuple[int, int, int]]) -> int:
    """WillWrite + Written as the data thread does; returns the open part's txn."""
    begin = of(m.handle(WillWrite()), BeginPart)
    txn = begin[0].txn if begin else m.open.txn  # type: ignore[union-attr]
    m.handle(Written(txn, batch))
    return txn


def prepare_and_vote(m: ParticipantMachine, txn: int) -> list[Action]:
    (ask,) = m.handle(Received(env(Prepare(txn, 0))))
    assert ask == PreparePart(txn)
    (ready,) = m.handle(Cut(txn))
    assert isinstance(ready, PreparePart) and ready.ready
    return [ready, *m.handle(PrepareDone(txn))]


def test_replay_acts_on_nothing_and_assignment_seeks_to_committed_positions() -> None:
    m = ParticipantMachine(ParticipantSettings("a", SINKS))
    d = commit(1, Part("a", 1, SINKS), pos={TP0: 7})
    assert m.handle(Received(env(Prepare(1, 0)), replay=True)) == []
    assert m.handle(Received(env(d), replay=True)) == []
    assert not m.ready
    m.handle(CaughtUp())
    acts = m.handle(Assigned(2, "a-1", {TP0: 3, TP1: 4}))
    # The log's position wins over the group's offset; the group's offset is the fallback.
    assert of(acts, Seek) == [Seek({TP0: 7, TP1: 4})]
    assert not m.ready  # not before the start-up in-doubt listing
    m.handle(InDoubt(()))
    assert m.ready


def test_first_write_begins_the_next_transaction_once() -> None:
    m = machine()
    assert m.handle(WillWrite()) == [BeginPart(1)]
    assert m.handle(WillWrite()) == []


def test_prepare_cuts_the_open_part_and_votes_its_exact_ranges() -> None:
    m = machine()
    write(m, {TP0: (4, 5, 0)})
    write(m, {TP0: (6, 2, 1)})
    ready, vote_action = prepare_and_vote(m, 1)
    assert isinstance(ready, PreparePart)
    assert ready.positions == {TP0: 7, TP1: 10} and ready.sinks == SINKS
    (send,) = of([vote_action], SendVote)
    v = send.vote
    assert v.vote is VoteValue.PREPARED and v.generation == 3 and v.member_id == "a-1"
    assert [(p.partition, p.start, p.end, p.records, p.dead_lettered) for p in v.partitions] == [
        (0, 0, 7, 7, 1),
        (1, 10, 10, 0, 0),
    ]
    # The next part starts where the prepared one ends.
    assert m.handle(WillWrite()) == [BeginPart(2)]
    assert m.open is not None and m.open.start == {TP0: 7, TP1: 10}


def test_a_batch_written_before_the_cut_goes_into_the_part_being_cut() -> None:
    m = machine()
    assert m.handle(Received(env(Prepare(1, 0)))) == [PreparePart(1)]
    # The data thread polled before it saw the PREPARE: it writes one more batch first.
    assert m.handle(WillWrite()) == [BeginPart(1)]
    m.handle(Written(1, {TP0: (2, 3, 0)}))
    (ready,) = m.handle(Cut(1))
    assert isinstance(ready, PreparePart) and ready.txn == 1 and ready.sinks == SINKS
    assert ready.positions == {TP0: 3, TP1: 10}


def test_an_idle_participant_votes_empty_ranges_and_prepares_no_sink() -> None:
    m = machine()
    ready, vote_action = prepare_and_vote(m, 1)
    assert isinstance(ready, PreparePart) and ready.sinks == ()
    assert isinstance(vote_action, SendVote) and vote_action.vote.sinks == ()


def test_a_duplicate_prepare_is_ignored() -> None:
    m = machine()
    write(m, {TP0: (0, 1, 0)})
    prepare_and_vote(m, 1)
    again = m.handle(Received(env(Prepare(1, 0))))
    assert [type(a) for a in again] == [Log]  # said, and nothing cut or voted twice


def test_commit_decision_applies_and_acknowledges() -> None:
    m = machine()
    write(m, {TP0: (0, 1, 0)})
    prepare_and_vote(m, 1)
    acts = m.handle(Received(env(commit(1, Part("a", 3, SINKS), pos={TP0: 1, TP1: 10}))))
    assert of(acts, CommitPart) == [CommitPart(1, "a", SINKS)]
    assert not of(acts, Seek)  # the next part already starts at the committed positions
    assert m.handle(PartApplied(1, "a", Outcome.COMMIT)) == [SendApplied(Applied(1, "a", "a"))]


def test_abort_decision_aborts_and_rewinds_the_open_part() -> None:
    m = machine()
    write(m, {TP0: (0, 1, 0)})
    prepare_and_vote(m, 1)
    write(m, {TP0: (3, 3, 0)})  # part 2 builds on part 1's end
    acts = m.handle(Received(env(Decision(1, Outcome.ABORT, reason="timeout"))))
    assert AbortPart(1, "a", SINKS) in acts  # the prepared part, on the control thread
    assert AbortPart(2, "a", SINKS, thread=Thread.DATA) in acts  # the open part
    # Never committed anything: back to the group's offsets.
    assert of(acts, Seek) == [Seek({TP0: 0, TP1: 10})]
    assert m.handle(PartApplied(1, "a", Outcome.ABORT)) == []


def test_a_commit_that_leaves_us_out_aborts_our_part_and_rewinds() -> None:
    m = machine()
    write(m, {TP0: (0, 1, 0)})
    prepare_and_vote(m, 1)
    acts = m.handle(Received(env(commit(1, Part("b", 4, SINKS), pos={TP0: 5, TP1: 10}))))
    assert AbortPart(1, "a", SINKS) in acts
    assert of(acts, Seek) == [Seek({TP0: 5, TP1: 10})]


def test_prepare_failure_votes_abort_and_rewinds() -> None:
    m = machine()
    write(m, {TP0: (0, 1, 0)})
    m.handle(Received(env(Prepare(1, 0))))
    m.handle(Cut(1))
    acts = m.handle(PrepareFailed(1, "disk full"))
    (send,) = of(acts, SendVote)
    assert send.vote.vote is VoteValue.ABORT and send.vote.reason == "disk full"
    assert AbortPart(1, "a", SINKS, thread=Thread.DATA) in acts
    assert of(acts, Seek) == [Seek({TP0: 0, TP1: 10})]


def test_a_prepare_re_read_after_a_failed_prepare_is_ignored() -> None:
    m = machine()
    write(m, {TP0: (0, 1, 0)})
    m.handle(Received(env(Prepare(1, 0))))
    m.handle(Cut(1))
    m.handle(PrepareFailed(1, "disk full"))
    assert [type(a) for a in m.handle(Received(env(Prepare(1, 0))))] == [Log]
    assert m.handle(WillWrite()) == [BeginPart(2)]  # never part 1 again: it may be aborted


def test_revoke_abandons_the_open_part_and_its_late_writes() -> None:
    m = machine()
    m.handle(WillWrite())
    acts = m.handle(Revoked())
    assert AbortPart(1, "a", SINKS, thread=Thread.DATA) in acts
    assert m.handle(Written(1, {TP0: (0, 1, 0)})) == []
    assert not m.ready


def test_in_doubt_own_part_is_resolved_from_the_log_or_when_decided() -> None:
    m = ParticipantMachine(ParticipantSettings("a", SINKS))
    m.handle(Received(env(Prepare(1, 0)), replay=True))
    m.handle(Received(env(commit(1, Part("a", 1, SINKS), pos={TP0: 2})), replay=True))
    m.handle(Received(env(Prepare(2, 0)), replay=True))
    m.handle(CaughtUp())
    acts = m.handle(InDoubt((("pg", 1, "a"), ("mongo", 1, "a"), ("pg", 2, "a"))))
    assert of(acts, CommitPart) == [CommitPart(1, "a", ("mongo", "pg"))]
    acts = m.handle(Received(env(Decision(2, Outcome.ABORT, reason="x"))))
    assert of(acts, AbortPart) == [AbortPart(2, "a", ("pg",))]


def test_sweep_finishes_a_foreign_part_only_after_it_sat_for_a_whole_sweep() -> None:
    m = machine()
    m.handle(Received(env(Prepare(1, 0))))
    m.handle(Received(env(commit(1, Part("dead", 1, ("pg",)), pos={TP0: 0}))))
    assert m.handle(Tick(0)) == [Sweep()]
    assert m.handle(Tick(500)) == []
    alive = frozenset({"a"})
    assert of(m.handle(InDoubt((("pg", 1, "dead"),), sweep=True, live=alive)), CommitPart) == []
    acts = m.handle(InDoubt((("pg", 1, "dead"),), sweep=True, live=alive))
    assert of(acts, CommitPart) == [CommitPart(1, "dead", ("pg",))]
    assert m.handle(PartApplied(1, "dead", Outcome.COMMIT)) == [
        SendApplied(Applied(1, "dead", "a"))
    ]


def test_a_stale_listing_still_commits_every_sink_the_vote_named() -> None:
    """The listing caught the part prepared in pg only (its owner was still preparing mongo);
    committing pg alone and acknowledging would let the part be presumed aborted in mongo."""
    m = machine()
    m.handle(Received(env(Prepare(1, 0))))
    assert of(m.handle(InDoubt((("pg", 1, "b"),))), CommitPart) == []  # undecided yet
    acts = m.handle(Received(env(commit(1, Part("b", 3, SINKS), pos={TP0: 0, TP1: 10}))))
    assert of(acts, CommitPart) == [CommitPart(1, "b", ("mongo", "pg"))]
    assert m.handle(PartApplied(1, "b", Outcome.COMMIT)) == [SendApplied(Applied(1, "b", "a"))]


def test_no_acknowledgement_for_a_part_with_sinks_we_do_not_have() -> None:
    m = ParticipantMachine(ParticipantSettings("a", ("pg",)))
    m.handle(Received(env(Prepare(1, 0)), replay=True))
    m.handle(Received(env(commit(1, Part("b", 3, ("pg", "files")), pos={})), replay=True))
    m.handle(CaughtUp())
    (c,) = of(m.handle(InDoubt((("pg", 1, "b"),))), CommitPart)
    assert c == CommitPart(1, "b", ("pg",))
    assert of(m.handle(PartApplied(1, "b", Outcome.COMMIT)), SendApplied) == []


def test_sweep_leaves_a_live_owners_parts_and_unknown_membership_alone() -> None:
    m = machine()
    m.handle(Received(env(Prepare(1, 0))))
    m.handle(Received(env(commit(1, Part("b", 1, ("pg",)), pos={TP0: 0}))))
    for _ in range(3):  # however often it is seen: b is a live member and applies its own part
        acts = m.handle(InDoubt((("pg", 1, "b"),), sweep=True, live=frozenset({"a", "b"})))
        assert of(acts, CommitPart) == []
    for _ in range(3):  # membership unknown: touch nothing foreign
        assert of(m.handle(InDoubt((("pg", 1, "b"),), sweep=True, live=None)), CommitPart) == []
    m.handle(InDoubt((("pg", 1, "b"),), sweep=True, live=frozenset({"a"})))
    acts = m.handle(InDoubt((("pg", 1, "b"),), sweep=True, live=frozenset({"a"})))
    assert of(acts, CommitPart) == [CommitPart(1, "b", ("pg",))]  # b left the group: finish it


def test_an_idle_vote_is_cast_again_in_the_generation_that_brings_partitions() -> None:
    m = ParticipantMachine(ParticipantSettings("a", SINKS))
    m.handle(CaughtUp())
    acts = prepare_and_vote(m, 1)  # not assigned yet: an idle vote
    (idle,) = of(acts, SendVote)
    assert idle.vote.partitions == () and idle.vote.generation == -1
    acts = m.handle(Assigned(5, "a-5", {TP0: 2, TP1: 0}))
    (again,) = of(acts, SendVote)
    v = again.vote
    assert v.txn == 1 and v.generation == 5 and v.sinks == ()
    assert [(p.partition, p.start, p.end) for p in v.partitions] == [(0, 2, 2), (1, 0, 0)]
    # Once decided there is nothing left to re-vote.
    m.handle(Received(env(commit(1, Part("a", 5, ()), pos={TP0: 2, TP1: 0}))))
    assert of(m.handle(Assigned(6, "a-6", {TP0: 2, TP1: 0})), SendVote) == []


def test_a_prepare_in_flight_at_start_up_is_voted_at_the_first_assignment() -> None:
    m = ParticipantMachine(ParticipantSettings("a", SINKS))
    m.handle(Received(env(Prepare(4, 0)), replay=True))
    m.handle(CaughtUp())
    m.handle(InDoubt(()))
    acts = m.handle(Assigned(2, "a-2", {TP0: 7, TP1: 1}))
    (ready,) = of(acts, PreparePart)
    assert ready.txn == 4 and ready.ready and ready.sinks == ()
    assert ready.positions == {TP0: 7, TP1: 1}
    (send,) = of(m.handle(PrepareDone(4)), SendVote)
    assert [(p.partition, p.start, p.end) for p in send.vote.partitions] == [(0, 7, 7), (1, 1, 1)]


def test_a_prepare_in_flight_at_start_up_is_not_voted_when_own_part_is_prepared() -> None:
    m = ParticipantMachine(ParticipantSettings("a", SINKS))
    m.handle(Received(env(Prepare(4, 0)), replay=True))
    m.handle(CaughtUp())
    m.handle(InDoubt((("pg", 4, "a"),)))
    assert of(m.handle(Assigned(2, "a-2", {TP0: 7})), PreparePart) == []


@pytest.mark.parametrize("own_part_prepared", [False, True])
def test_an_assignment_before_the_start_up_listing_waits_for_it(own_part_prepared: bool) -> None:
    """The class behind simulator seed 9841: the PREPARE open at start-up is voted (empty) only
    on an assignment that comes after the start-up listing, and only when no part of this
    participant's earlier incarnation is prepared for it. Not when the listing comes last:
    the data thread could write into the part before it cuts it (seed 25043)."""
    m = ParticipantMachine(ParticipantSettings("a", SINKS))
    m.handle(Received(env(Prepare(4, 0)), replay=True))
    m.handle(CaughtUp())
    acts = m.handle(Assigned(2, "a-2", {TP0: 7}))
    assert of(acts, PreparePart) == [] and of(acts, Seek) == [Seek({TP0: 7})]
    assert not m.ready
    listed = (("pg", 4, "a"),) if own_part_prepared else ()
    assert of(m.handle(InDoubt(listed)), PreparePart) == []
    assert m.ready
    prepares = of(m.handle(Assigned(3, "a-3", {TP0: 7})), PreparePart)
    if own_part_prepared:
        assert prepares == []
    else:
        (ready,) = prepares
        assert ready.txn == 4 and ready.ready and ready.sinks == () and ready.positions == {TP0: 7}
    assert of(m.handle(Assigned(4, "a-4", {TP0: 7})), PreparePart) == []  # once only


# -- DRAINED: read to the end, the input quiet ---------------------------------------------------


def test_a_quiet_participant_holding_records_says_drained_once_per_transaction() -> None:
    m = machine()
    assert m.handle(Quiet({TP0: 0, TP1: 10})) == []  # nothing in hand, no peer holds any
    write(m, {TP0: (4, 4, 1)})
    (send,) = m.handle(Quiet({TP0: 5, TP1: 10}))
    assert send == SendDrained(
        Drained(0, "a", 3, (Position(T, 0, 5), Position(T, 1, 10)), 5), thread=Thread.DATA
    )
    assert m.handle(Quiet({TP0: 5, TP1: 10})) == []  # said already for this transaction
    prepare_and_vote(m, 1)
    write(m, {TP1: (11, 2, 0)})
    (send,) = m.handle(Quiet({TP0: 5, TP1: 12}))
    assert send.drained.after_txn == 1 and send.drained.records == 2


def test_between_a_prepare_and_its_vote_nothing_is_said() -> None:
    """The records in hand belong to the transaction being cut, not to the next one."""
    m = machine()
    write(m, {TP0: (4, 5, 0)})
    assert m.handle(Received(env(Prepare(1, 0)))) == [PreparePart(1)]
    assert m.handle(Quiet({TP0: 5, TP1: 10})) == []
    m.handle(Cut(1))
    assert m.handle(Quiet({TP0: 5, TP1: 10})) == []
    m.handle(PrepareDone(1))
    assert m.handle(Quiet({TP0: 5, TP1: 10})) == []  # the new open part holds nothing


def test_an_empty_participant_answers_a_peer_that_holds_records() -> None:
    """The coordinator needs every partition covered: a participant whose partitions got
    nothing says drained too -- but only once a peer holding records has (an idle pipeline
    sends nothing)."""
    m = machine()
    peer = Drained(0, "b", 3, (Position(T, 2, 9),), 0)
    m.handle(Received(env(peer)))
    assert m.handle(Quiet({TP0: 0, TP1: 10})) == []  # the peer holds nothing either
    m.handle(Received(env(Drained(0, "b", 3, (Position(T, 2, 9),), 700))))
    (send,) = m.handle(Quiet({TP0: 0, TP1: 10}))
    assert send.drained.records == 0 and send.drained.after_txn == 0
    # Its own hint, read back, is not a peer's.
    other = machine(name="c")
    other.handle(Received(env(Drained(0, "c", 3, (Position(T, 0, 1),), 700))))
    assert other.handle(Quiet({TP0: 0, TP1: 10})) == []


def test_a_new_assignment_is_worth_saying_again() -> None:
    m = machine()
    write(m, {TP0: (4, 5, 0)})
    assert m.handle(Quiet({TP0: 5, TP1: 10}))
    m.handle(Assigned(4, "a-2", {TP0: 0}))
    write(m, {TP0: (2, 3, 0)})
    (send,) = m.handle(Quiet({TP0: 3}))
    assert send.drained.generation == 4 and send.drained.positions == (Position(T, 0, 3),)


def test_said_again_only_when_the_part_has_more_than_doubled() -> None:
    """A pause inside a burst, then the rest of it: the later, larger part is said too (the
    first hint may have been below the coordinator's minimum); small growth is not."""
    m = machine()
    write(m, {TP0: (9, 10, 0)})
    (first,) = m.handle(Quiet({TP0: 10, TP1: 10}))
    assert first.drained.records == 10
    write(m, {TP0: (19, 10, 0)})  # 20 records: not more than double
    assert m.handle(Quiet({TP0: 20, TP1: 10})) == []
    write(m, {TP0: (20, 1, 0)})  # 21
    (again,) = m.handle(Quiet({TP0: 21, TP1: 10}))
    assert again.drained.records == 21 and again.drained.after_txn == first.drained.after_txn
    # A reply that held nothing is followed by one with the participant's own records.
    other = machine(name="c")
    other.handle(Received(env(Drained(0, "b", 3, (Position(T, 2, 9),), 700))))
    (reply,) = other.handle(Quiet({TP0: 0, TP1: 10}))
    assert reply.drained.records == 0
    write(other, {TP1: (10, 1, 0)})
    (own,) = other.handle(Quiet({TP0: 0, TP1: 11}))
    assert own.drained.records == 1
