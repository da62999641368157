"""How far back the sinks may forget decided parts' markers (``ParticipantMachine.forget_before``),
and the setting that keeps a margin of them (``participant.keep_decided_txns``)."""

from __future__ import annotations

from typing import Any

import pytest

from twophase.config import parse_config
from twophase.errors import ConfigError
from twophase.participants.machine import (
    CaughtUp,
    ParticipantMachine,
    ParticipantSettings,
    Received,
    Sweep,
    Tick,
)
from twophase.protocol.messages import (
    Applied,
    Checkpoint,
    Complete,
    Decision,
    Envelope,
    Outcome,
    Part,
    Payload,
    PendingCommit,
    Position,
    Prepare,
)

PARTS = (Part("a", 1, ("pg",)), Part("b", 1, ("pg",)))


def machine(keep: int, *msgs: Payload, caught_up: bool = True) -> ParticipantMachine:
    m = ParticipantMachine(ParticipantSettings("a", ("pg",), keep_decided_txns=keep))
    for msg in msgs:
        m.handle(Received(Envelope("id", "pipe", "test", 0, msg), replay=True))
    if caught_up:
        m.handle(CaughtUp())
    return m


def committed_and_complete(first: int, last: int) -> list[Payload]:
    """Transactions first..last, each committed, applied by both parts and completed."""
    out: list[Payload] = []
    for txn in range(first, last + 1):
        out += [
            Prepare(txn, 0),
            Decision(txn, Outcome.COMMIT, PARTS, (Position("s", 0, txn),)),
            Applied(txn, "a", "a"),
            Applied(txn, "b", "b"),
            Complete(txn),
        ]
    return out


def test_the_margin_keeps_the_newest_decided_transactions() -> None:
    m = machine(5, *committed_and_complete(1, 20))
    # 16..20 keep their markers: forget below 16.
    assert m.forget_before() == 16
    assert machine(0, *committed_and_complete(1, 20)).forget_before() == 21


def test_aborted_transactions_count_as_decided() -> None:
    msgs = committed_and_complete(1, 10)
    msgs += [Prepare(11, 0), Decision(11, Outcome.ABORT, reason="vote timeout")]
    assert machine(3, *msgs).forget_before() == 9


def test_a_pending_commit_holds_the_bound_back() -> None:
    """A commit not yet applied by every part is re-applied at start-up and on sweeps; its
    markers (and everything after it) stay, however far the log has moved on."""
    msgs = committed_and_complete(1, 10)
    msgs += [Prepare(11, 0), Decision(11, Outcome.COMMIT, PARTS), Applied(11, "a", "a")]
    msgs += committed_and_complete(12, 40)
    m = machine(5, *msgs)
    assert m.log.pending.keys() == {11}
    assert m.forget_before() == 11
    # b applies it, the coordinator completes it: the bound moves up to the margin.
    m.handle(Received(Envelope("id", "pipe", "test", 0, Applied(11, "b", "b"))))
    m.handle(Received(Envelope("id", "pipe", "test", 0, Complete(11))))
    assert m.forget_before() == 36


def test_a_checkpoint_pending_commit_holds_the_bound_back() -> None:
    """A reader starting at a checkpoint knows the pending commits from it alone."""
    cp = Checkpoint(50, (Position("s", 0, 9),), (PendingCommit(42, PARTS, ("a",)),))
    assert machine(1, cp).forget_before() == 42
    assert machine(1, Checkpoint(50, (Position("s", 0, 9),))).forget_before() == 50


def test_nothing_below_one_and_nothing_before_caught_up() -> None:
    assert machine(1000, *committed_and_complete(1, 20)).forget_before() == 0
    assert machine(0).forget_before() == 0  # nothing decided yet
    # Transaction 1 is the oldest there is: a bound of 1 forgets nothing, 2 forgets txn 1.
    assert machine(20, *committed_and_complete(1, 20)).forget_before() == 0
    assert machine(19, *committed_and_complete(1, 20)).forget_before() == 2
    assert machine(0, *committed_and_complete(1, 20), caught_up=False).forget_before() == 0
    # The first transaction pending: nothing can go.
    first_pending: list[Payload] = [Prepare(1, 0), Decision(1, Outcome.COMMIT, PARTS)]
    assert machine(0, *first_pending, *committed_and_complete(2, 9)).forget_before() == 0


def test_the_sweep_carries_the_bound() -> None:
    m = machine(5, *committed_and_complete(1, 20))
    assert m.handle(Tick(0)) == [Sweep(forget_before=16)]
    assert m.handle(Tick(1)) == []  # not yet another sweep
    assert machine(5).handle(Tick(0)) == [Sweep()]


def _config(**participant: Any) -> dict[str, Any]:
    return {
        "pipeline": "p",
        "kafka": {"bootstrap_servers": "k:9092"},
        "sources": [{"topic": "t"}],
        "sinks": [{"name": "f", "type": "files", "path": "/tmp/x"}],
        "participant": participant,
    }


def test_keep_decided_txns_defaults_to_1000_and_is_validated() -> None:
    assert parse_config(_config(), env={}).participant.keep_decided_txns == 1000
    assert parse_config(_config(keep_decided_txns=0), env={}).participant.keep_decided_txns == 0
    with pytest.raises(ConfigError) as err:
        parse_config(_config(keep_decided_txns=-1), env={})
    assert err.value.field == "participant.keep_decided_txns"
    override = {"TWOPHASE__PARTICIPANT__KEEP_DECIDED_TXNS": "5"}
    assert parse_config(_config(), env=override).participant.keep_decided_txns == 5
