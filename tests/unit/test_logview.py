"""The folded view of the control log that recovery relies on."""

from __future__ import annotations

from twophase.protocol.logview import LogView
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


def fold(*msgs: Payload, view: LogView | None = None) -> LogView:
    view = view or LogView()
    for m in msgs:
        view.apply(Envelope("id", "pipe", "test", 0, m))
    return view


def test_outcomes_commit_abort_presumed_abort_and_undecided() -> None:
    v = fold(
        Prepare(1, 0),
        Decision(1, Outcome.COMMIT, PARTS[:1], (Position("s", 0, 4),)),
        Prepare(2, 0),
        Decision(2, Outcome.ABORT, reason="x"),
        Prepare(3, 0),
    )
    assert v.outcome_of(1, "a") is Outcome.COMMIT
    assert v.outcome_of(1, "b") is Outcome.ABORT  # not named by the commit
    assert v.outcome_of(2, "a") is Outcome.ABORT
    assert v.outcome_of(3, "a") is None
    assert v.positions == {("s", 0): 4} and v.last_txn == 3 and v.last_decided == 2


def test_a_reader_starting_at_a_checkpoint_knows_what_it_needs() -> None:
    cp = Checkpoint(5, (Position("s", 0, 9),), (PendingCommit(4, PARTS, ("a",)),))
    v = fold(cp)
    assert v.outcome_of(4, "b") is Outcome.COMMIT  # pending: committed, not yet applied
    assert v.outcome_of(3, "a") is Outcome.ABORT  # decided before, not pending: presumed abort
    assert v.positions == {("s", 0): 9}
    fold(Applied(4, "b", "b"), view=v)
    assert v.pending[4].complete
    fold(Complete(4), view=v)
    assert 4 not in v.pending


def test_a_checkpoint_replaces_acknowledgements_so_every_reader_agrees() -> None:
    """The writer may not have read an APPLIED that landed before its checkpoint: a live reader
    that did must forget it too, or nobody would ever re-send it to a new leader."""
    live = fold(Prepare(1, 0), Decision(1, Outcome.COMMIT, PARTS), Applied(1, "a", "a"))
    cp = Checkpoint(1, (), (PendingCommit(1, PARTS, ()),))
    fold(cp, view=live)
    fresh = fold(cp)
    assert live.pending[1].acked == fresh.pending[1].acked == set()


def test_an_older_checkpoint_changes_nothing() -> None:
    v = fold(Prepare(1, 0), Decision(1, Outcome.COMMIT, PARTS), Prepare(2, 0))
    v.apply(Envelope("id", "pipe", "test", 0, Checkpoint(0, (), ())))
    assert 1 in v.pending and v.outcome_of(2, "a") is None
