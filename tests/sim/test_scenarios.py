"""Hand-written fault scenarios on the simulator: each puts one named fault at one exact point of
a commit cycle, then drives the world to quiescence and checks every guarantee."""

from __future__ import annotations

from twophase.coordinator.machine import Phase
from twophase.protocol.messages import Decision, Outcome, Prepare, Vote

from .world import COMMITTED, PREPARED, Params, Participant, World


def calm(seed: int, **kw: int) -> World:
    return World(seed, params=Params.calm(**kw))


def commits(w: World) -> int:
    return sum(1 for d in w.log_view.decisions.values() if d.outcome is Outcome.COMMIT)


def decision(w: World, txn: int) -> Decision | None:
    return w.log_view.decisions.get(txn)


def votes(w: World, txn: int) -> list[Vote]:
    return [e.payload for e in w.log if isinstance(e.payload, Vote) and e.payload.txn == txn]


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
    w = calm(5)
    txn = at_fresh_prepare(w)
    leader = w.leader
    assert leader is not None
    leader.hold = True
    w.run_until(lambda: all_voted(w, txn))
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
    w = calm(3)
    txn = at_fresh_prepare(w)
    leader = w.leader
    assert leader is not None
    leader.hold = True
    w.run_until(lambda: all_voted(w, txn))
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
    w = calm(9)
    txn = at_fresh_prepare(w)
    leader = w.leader
    assert leader is not None
    leader.hold = True
    w.run_until(lambda: all_voted(w, txn))
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
