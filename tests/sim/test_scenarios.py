"""Hand-written fault scenarios on the simulator: each puts one named fault at one exact point of
a commit cycle, then drives the world to quiescence and checks every guarantee."""

from __future__ import annotations

import dataclasses

import pytest

from twophase.coordinator.machine import Phase
from twophase.participants import machine as pm
from twophase.protocol.messages import (
    Applied,
    Checkpoint,
    Complete,
    Decision,
    Outcome,
    Prepare,
    Vote,
    VoteValue,
)

from .world import (
    ABORTED,
    COMMITTED,
    PREPARED,
    STORES,
    Coordinator,
    Params,
    Participant,
    SimViolation,
    World,
)


def calm(seed: int, **kw: int) -> World:
    return World(seed, params=Params.calm(**kw))


def commits(w: World) -> int:
    return sum(1 for d in w.log_view.decisions.values() if d.outcome is Outcome.COMMIT)


def decision(w: World, txn: int) -> Decision | None:
    return w.log_view.decisions.get(txn)


def votes(w: World, txn: int) -> list[Vote]:
    """The votes on ``txn`` in the order they landed, on the reply or the control topic."""
    return [e.payload for e in w.landed() if isinstance(e.payload, Vote) and e.payload.txn == txn]


def has_data(p: Participant) -> bool:
    part = p.machine.open
    return part is not None and part.begun and sum(part.records.values()) > 0


def at_fresh_prepare(w: World, after_commits: int = 1) -> int:
    """Run until a PREPARE has just been written (after some commits), nobody has read it yet,
    and some participant has records in its open part; return its txn."""
    w.run_until(
        lambda: (
            commits(w) >= after_commits
            and isinstance(w.log[-1].payload, Prepare)
            and all(p.cursor < len(w.log) for p in w.participants)
            and any(has_data(p) for p in w.participants)
        )
    )
    msg = w.log[-1].payload
    assert isinstance(msg, Prepare)
    return msg.txn


def voted_and_held(seed: int) -> tuple[World, int, Coordinator]:
    """A calm world at a fresh PREPARE whose every vote is in, the leader held before it
    decides: the world, the txn and the held leader."""
    w = calm(seed)
    txn = at_fresh_prepare(w)
    leader = w.leader
    assert leader is not None
    leader.hold = True
    w.run_until(lambda: all_voted(w, txn))
    return w, txn, leader


def all_voted(w: World, txn: int) -> bool:
    return {v.participant for v in votes(w, txn)} == {p.name for p in w.participants}


def voter_with_data(w: World, txn: int) -> Participant:
    name = next(v.participant for v in votes(w, txn) if v.sinks)
    return next(p for p in w.participants if p.name == name)


def finish(w: World) -> None:
    w.quiesce()
    w.check()


def test_deposed_coordinator_cannot_decide() -> None:
    w = calm(1)
    txn = at_fresh_prepare(w, after_commits=2)
    old = w.leader
    assert old is not None
    w.depose()
    old.lost_at = None  # it never hears that it lost the lease: only fencing can stop it
    assert w.leader is not old
    start = len(w.log)
    w.run_until(lambda: old.machine.phase is Phase.STANDBY)
    assert old.fenced_writes >= 1, "the zombie never tried to write"
    assert old.epoch not in w.log_epochs[start:], "a deposed coordinator wrote to the log"
    w.run_until(lambda: decision(w, txn) is not None)
    d = decision(w, txn)
    assert d is not None and d.outcome is Outcome.ABORT and "presumed abort" in d.reason
    finish(w)


def test_rebalance_mid_cycle_aborts_and_data_lands_once() -> None:
    w = calm(11)
    txn = at_fresh_prepare(w)
    for p in w.participants:
        p.hold_control = True  # nobody reads the PREPARE yet
    zombie = next(p for p in w.participants if w.assignment.get(p.member_id))
    old_generation = zombie.machine.generation
    w.kick(zombie)  # the group moves on without it; it keeps working in its generation
    w.rejoins.clear()
    others = [p for p in w.participants if p is not zombie]
    w.run_until(lambda: all(p.machine.generation == w.generation for p in others))
    zombie.hold_control = False
    w.run_until(lambda: zombie.name in {v.participant for v in votes(w, txn)})
    assert votes(w, txn)[0].generation == old_generation and votes(w, txn)[0].partitions
    for p in others:
        p.hold_control = False
    w.run_until(lambda: decision(w, txn) is not None)
    d = decision(w, txn)
    assert d is not None and d.outcome is Outcome.ABORT and "generations" in d.reason, d
    w.group_join(zombie)  # it notices and rejoins
    finish(w)


def test_participant_crash_after_vote_before_decision() -> None:
    w, txn, leader = voted_and_held(5)
    victim = voter_with_data(w, txn)
    w.crash_participant(victim)
    leader.hold = False
    w.run_until(lambda: decision(w, txn) is not None)
    d = decision(w, txn)
    assert d is not None and d.outcome is Outcome.COMMIT and d.includes(victim.name)
    key = (txn, victim.name)
    assert all(s.parts[key].state == PREPARED for s in w.stores.values())
    finish(w)  # the restarted incarnation finds its prepared part and commits it
    assert all(s.parts[key].state == COMMITTED for s in w.stores.values())


def test_coordinator_crash_after_prepare_is_presumed_abort() -> None:
    w, txn, leader = voted_and_held(3)
    prepared = [(txn, v.participant) for v in votes(w, txn) if v.sinks]
    assert prepared
    w.crash_coordinator(leader)
    w.run_until(lambda: decision(w, txn) is not None)
    d = decision(w, txn)
    assert d is not None and d.outcome is Outcome.ABORT and "presumed abort" in d.reason, d
    finish(w)
    for key in prepared:
        assert all(s.parts[key].state != PREPARED for s in w.stores.values())


def test_crash_mid_apply_finishes_the_commit() -> None:
    w, txn, leader = voted_and_held(9)
    victim = voter_with_data(w, txn)
    key = (txn, victim.name)
    w.stores["mongo"].fail_next = 10**6  # pg commits, mongo keeps timing out
    leader.hold = False
    w.run_until(
        lambda: key in w.stores["pg"].parts and w.stores["pg"].parts[key].state == COMMITTED
    )
    assert w.stores["mongo"].parts[key].state == PREPARED
    w.crash_participant(victim)
    w.stores["mongo"].fail_next = 0
    finish(w)
    assert w.stores["mongo"].parts[key].state == COMMITTED


def test_repeated_failures_raise_an_alarm_and_recovery_clears_it() -> None:
    w = calm(2)
    w.run_until(lambda: commits(w) >= 1)
    w.p.p_prepare_fail = 1.0  # every sink refuses to prepare: every cycle with data aborts
    w.run_until(lambda: any(a.active for _, a in w.alarms))
    raised = next(a for _, a in w.alarms if a.active)
    assert raised.failed_cycles >= 4 and "consecutive" in raised.message
    w.p.p_prepare_fail = 0.0
    w.run_until(lambda: not w.alarms[-1][1].active)
    finish(w)


# -- network faults ------------------------------------------------------------------------------


def outgoing_vote(p: Participant, txn: int) -> Vote | None:
    """``p``'s vote on ``txn`` waiting in its producer, if it has data."""
    for out in p.outbox:
        if isinstance(out.msg, Vote) and out.msg.txn == txn and out.msg.sinks:
            return out.msg
    return None


def test_participant_cut_off_from_kafka_votes_too_late() -> None:
    """Prepared, its vote still in its producer, a participant loses Kafka (not its stores):
    the cycle aborts on its deadline, the group drops the participant, the vote lands after
    the decision and changes nothing, and the prepared part is aborted once it hears."""
    w = calm(21)
    txn = at_fresh_prepare(w)
    w.run_until(lambda: any(outgoing_vote(p, txn) for p in w.participants))
    victim = next(p for p in w.participants if outgoing_vote(p, txn))
    w.cut_kafka(victim.name, w.now + 700, session=150)
    w.run_until(lambda: decision(w, txn) is not None)
    d = decision(w, txn)
    assert d is not None and d.outcome is Outcome.ABORT and "vote timeout" in d.reason, d
    assert victim.member_id not in w.members, "the group kept a member it could not hear"
    finish(w)
    landed = list(w.landed())
    decided = next(i for i, e in enumerate(landed) if e.payload == d)
    late = [
        i
        for i, e in enumerate(landed)
        if e.payload == outgoing_vote(victim, txn)
        or (
            isinstance(e.payload, Vote)
            and e.payload.txn == txn
            and e.payload.participant == victim.name
        )
    ]
    assert late and late[0] > decided, "the vote was not late"
    key = (txn, victim.name)
    assert all(s.parts[key].state == ABORTED for s in w.stores.values())


def test_participant_cut_off_from_a_store_commits_when_it_heals() -> None:
    """The reverse: a participant reaches Kafka but not one of its stores when the commit
    decision comes. The other store commits at once, this one when the partition heals; the
    sweeps of the others leave the part of a live member alone meanwhile."""
    w, txn, leader = voted_and_held(22)
    victim = voter_with_data(w, txn)
    key = (txn, victim.name)
    healed = w.now + 800
    w.store_cuts[(victim.name, "mongo")] = healed
    leader.hold = False
    w.run_until(lambda: decision(w, txn) is not None)
    d = decision(w, txn)
    assert d is not None and d.outcome is Outcome.COMMIT and d.includes(victim.name), d
    w.run_until(lambda: w.stores["pg"].parts[key].state == COMMITTED)
    assert w.stores["mongo"].parts[key].state == PREPARED and w.now < healed
    finish(w)
    assert w.stores["mongo"].parts[key].state == COMMITTED


def test_participant_cut_off_from_its_stores_while_writing_votes_abort() -> None:
    """A write that cannot reach a store is given up: the part is not whole, so its prepare
    fails without touching the sinks, the participant votes abort and reads again."""
    w = calm(23)
    w.run_until(lambda: commits(w) >= 1 and any(has_data(p) for p in w.participants))
    victim = next(p for p in w.participants if has_data(p))
    victim.hold_control = True  # no PREPARE cuts the part meanwhile
    w.records_left += 20
    w.store_cuts[(victim.name, "pg")] = w.now + 1200
    w.run_until(lambda: victim.failed_txn is not None)
    assert victim.poisoned and w.now < w.store_cuts[(victim.name, "pg")]
    victim.hold_control = False

    def abort_vote() -> Vote | None:
        mine = [e.payload for e in w.landed() if isinstance(e.payload, Vote)]
        return next((v for v in mine if v.participant == victim.name and v.reason), None)

    w.run_until(lambda: abort_vote() is not None)
    vote = abort_vote()
    assert vote is not None and "write of this part failed" in vote.reason, vote
    w.run_until(lambda: decision(w, vote.txn) is not None)
    d = decision(w, vote.txn)
    assert d is not None and d.outcome is Outcome.ABORT, d
    finish(w)


def test_leader_cut_off_from_kafka_is_replaced_and_its_blocked_decision_fenced() -> None:
    """The leader loses Kafka right after its PREPARE: it hears no vote, decides abort on its
    deadline and blocks in that write. Its session ends first: the standby wins the control
    partition and presumes abort; when the old leader reaches Kafka again its write is fenced."""
    w = calm(24)
    txn = at_fresh_prepare(w)
    old = w.leader
    assert old is not None
    start = len(w.log)
    w.cut_kafka(old.name, w.now + 600, session=150)
    w.run_until(lambda: w.leader is not old)
    w.run_until(lambda: old.inflight is not None)
    w.run_until(lambda: old.machine.phase is Phase.STANDBY)
    assert old.fenced_writes >= 1, "the old leader's blocked write was not fenced"
    assert old.epoch not in w.log_epochs[start:], "a deposed coordinator wrote to the log"
    d = decision(w, txn)
    assert d is not None and d.outcome is Outcome.ABORT and "presumed abort" in d.reason, d
    finish(w)


def test_a_vote_delayed_past_the_deadline_changes_nothing() -> None:
    """Latency, no partition: a vote reaches the broker after the coordinator decided abort."""
    w = calm(25)
    txn = at_fresh_prepare(w)
    w.run_until(lambda: any(outgoing_vote(p, txn) for p in w.participants))
    victim = next(p for p in w.participants if outgoing_vote(p, txn))
    victim.outbox[0].lands = w.now + 600
    w.run_until(lambda: decision(w, txn) is not None)
    d = decision(w, txn)
    assert d is not None and d.outcome is Outcome.ABORT and "vote timeout" in d.reason, d
    finish(w)
    assert w.seen["vote lands after its decision"] >= 1


def test_participant_that_cannot_deliver_its_vote_exits_and_recovers() -> None:
    """Cut off from Kafka for longer than its producer tries: the process exits, restarts still
    cut off, and once the partition heals finds its prepared part and resolves it."""
    w = calm(26)
    txn = at_fresh_prepare(w)
    w.run_until(lambda: any(outgoing_vote(p, txn) for p in w.participants))
    victim = next(p for p in w.participants if outgoing_vote(p, txn))
    w.cut_kafka(victim.name, w.now + 1500, session=150)
    w.run_until(lambda: not victim.alive)
    assert w.seen["participant exits"] == 1
    assert not any(
        isinstance(e.payload, Vote)
        and e.payload.txn == txn
        and e.payload.participant == victim.name
        for e in w.landed()
    ), "a vote crossed the partition"
    finish(w)
    key = (txn, victim.name)
    assert all(s.parts[key].state == ABORTED for s in w.stores.values())


def test_prepare_that_cannot_reach_its_stores_is_given_up_and_votes_abort() -> None:
    """Cut off from both stores between reading the PREPARE and preparing: the prepare blocks,
    is given up, and the participant votes abort; its part is aborted once it heals."""
    w = calm(27)
    txn = at_fresh_prepare(w)
    victim = next(p for p in w.participants if has_data(p))
    victim.hold_data = True
    w.run_until(lambda: any(isinstance(a, pm.PreparePart) for a in victim.data_q))
    for s in STORES:
        w.store_cuts[(victim.name, s)] = w.now + 900
    victim.hold_data = False
    # The prepare outlasts the vote timeout: the coordinator has decided abort by then.
    w.run_until(lambda: any(v.participant == victim.name and v.reason for v in votes(w, txn)))
    vote = next(v for v in votes(w, txn) if v.participant == victim.name)
    assert vote.vote is VoteValue.ABORT and "unreachable" in vote.reason, vote
    assert w.seen["prepare given up"] == 1
    d = decision(w, txn)
    assert d is not None and d.outcome is Outcome.ABORT, d
    finish(w)


# -- the reply topic ----------------------------------------------------------------------------


def test_new_leader_reads_the_applied_since_the_checkpoint_from_the_reply_topic() -> None:
    """The leader writes a CHECKPOINT with a commit pending, then hears nothing more (held):
    every APPLIED of that commit lands on the reply topic past the checkpoint's replies_from.
    It crashes; the standby replays from the checkpoint, reads the reply topic from its
    replies_from and completes the commit on those APPLIED."""
    p = Params.calm()
    p.checkpoint_every = 1
    w = World(31, params=p)

    def fresh_checkpoint() -> Checkpoint | None:
        msg = w.log[-1].payload
        if isinstance(msg, Checkpoint) and msg.pending and msg.replies_from > 0:
            return msg
        return None

    w.run_until(lambda: commits(w) >= 2 and fresh_checkpoint() is not None)
    cp = fresh_checkpoint()
    old = w.leader
    assert cp is not None and old is not None
    old.hold = True
    unacked = {(pc.txn, part.participant) for pc in cp.pending for part in pc.parts} - {
        (pc.txn, name) for pc in cp.pending for name in pc.acked
    }
    assert unacked

    def applied_at() -> dict[tuple[int, str], int]:
        return {
            (e.payload.txn, e.payload.part): i
            for i, e in enumerate(w.replies)
            if isinstance(e.payload, Applied)
        }

    w.run_until(lambda: unacked <= set(applied_at()))
    assert all(applied_at()[key] >= cp.replies_from for key in unacked)
    w.crash_coordinator(old)
    txns = {txn for txn, _ in unacked}
    w.run_until(lambda: txns <= {e.payload.txn for e in w.log if isinstance(e.payload, Complete)})
    new = w.leader
    assert new is not None and new is not old and new.replies_start == cp.replies_from
    assert not any(isinstance(e.payload, Applied) for e in w.log), "an APPLIED on the control topic"
    finish(w)


def test_a_reply_topic_made_while_running_is_taken_up() -> None:
    """The reply topic appears while the pipeline runs: the leader finds it at a metadata
    refresh, reads it from its start and names it from then on; the participants move their
    replies there once they read a message naming it."""
    p = Params.calm()
    p.reply_topic_at = 600
    w = World(33, params=p)
    w.run_until(lambda: any(e.reply_to for e in w.log))
    first = next(i for i, e in enumerate(w.log) if e.reply_to)
    assert w.seen["reply topic found mid-reign"] == 1
    finish(w)
    assert any(isinstance(e.payload, Vote) for e in w.log[:first]), "no vote before it"
    assert any(isinstance(e.payload, Vote) for e in w.replies), "no vote on the reply topic"
    assert all(e.reply_to for e in w.log[first:] if e.sender.startswith("C"))


def test_a_participant_that_ignores_reply_to_is_caught() -> None:
    """The check that replies go where the coordinator reads them can fail: a participant that
    keeps replying on the control topic, in a world that expects none there, breaks it."""
    w = calm(32)
    w.participants[0].old = True  # ignores reply_to; the world does not know it
    with pytest.raises(SimViolation, match=r"\(8\) .* on the control topic"):
        finish(w)


@pytest.mark.parametrize("seed", [3, 5, 11])
def test_an_assignment_before_the_start_up_listing_votes_nothing_over_a_prepared_part(
    seed: int,
) -> None:
    """A participant dies with its part of a PREPARE prepared in the sinks but its vote unsent;
    restarted, its assignment reaches the machine before the start-up in-doubt listing (the
    runtime never lets it; the machine must not need that). It must not vote at all: an empty
    vote, once committed beside the old part, lets a sweep commit that part too, its records
    covered by no position, so read and written again (a random schedule found it, where the
    generations let the empty vote commit). Here the rule is checked where it acts: no vote."""
    w = calm(seed)
    # The restart outlasts the vote timeout: a long one keeps the transaction open for it.
    for c in w.coordinators:
        c.machine.settings = dataclasses.replace(c.machine.settings, vote_timeout_ms=10**9)
    txn = at_fresh_prepare(w)
    leader = w.leader
    assert leader is not None
    leader.hold = True

    def prepared_unsent() -> Participant | None:
        for p in w.participants:
            k = (txn, p.name)
            if all(k in s.parts and s.parts[k].state == PREPARED for s in w.stores.values()):
                return p
        return None

    w.run_until(lambda: prepared_unsent() is not None)
    victim = prepared_unsent()
    assert victim is not None
    key = (txn, victim.name)
    assert not any(v.participant == victim.name for v in votes(w, txn))
    victim.outbox.clear()  # died before its vote left
    w.crash_participant(victim)
    w.join_early = w.assign_early = True
    index = w.participants.index(victim)
    w.run_until(lambda: w.participants[index] is not victim and w.participants[index].caught_up)
    again = w.participants[index]
    again.hold_control = True  # the start-up listing waits: the assignment comes first
    w.run_until(lambda: again.machine.assigned)
    assert not again.machine.ready
    again.hold_control = False
    leader.hold = False
    # Time for a vote (the mutation that votes at the assignment fails just here).
    until = w.now + 500
    w.run_until(lambda: decision(w, txn) is not None or w.now >= until)
    assert decision(w, txn) is None
    assert not any(v.participant == victim.name for v in votes(w, txn))
    w.crash_coordinator(leader)  # the standby takes over: presumed abort
    finish(w)  # every record in the sinks exactly once, nothing left prepared
    d = decision(w, txn)
    assert d is not None and d.outcome is Outcome.ABORT
    assert all(s.parts[key].state == ABORTED for s in w.stores.values())
