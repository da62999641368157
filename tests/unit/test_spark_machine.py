"""The Spark driver's state machine, one decision at a time: the rows of the in-doubt table in
``docs/spark.md``, what an attempt publishes and when, and how a call ends. The simulator
(``tests/sim/test_spark_*.py``) drives the same machine through crashes and zombies."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import pytest

from twophase.errors import FencedError
from twophase.participants.sdk import PartId
from twophase.participants.spark import machine as sm
from twophase.participants.spark.machine import (
    DriverMachine,
    PipelineOwnerError,
    TaskResult,
    TwophaseBatchError,
)
from twophase.protocol import messages as msg

PIPELINE = "p"
OWNER = "spark:q1"
SINKS = ("a", "b")
#: The offset (tag) the PREPARE of the attempt under test lands at.
TAG = 10


def env(payload: msg.Payload, sender: str = OWNER) -> msg.Envelope:
    return msg.Envelope("id", PIPELINE, sender, 0, payload)


def part(txn: int, name: str) -> PartId:
    return PartId(PIPELINE, txn, name)


def drive(
    m: DriverMachine,
    batch_id: int,
    log: Sequence[msg.Payload] = (),
    *,
    in_doubt: Mapping[str, Sequence[PartId]] | None = None,
    stale: Mapping[str, Sequence[PartId]] | None = None,
    results: Sequence[TaskResult] = (),
    answer: Callable[[sm.Request], sm.Event | None] = lambda r: None,
) -> list[sm.Action]:
    """One call, answered the way a healthy writer would (``answer`` overrides); every action."""
    offsets = iter(range(TAG, 1000))
    out: list[sm.Action] = []
    todo = list(m.handle(sm.BatchCalled(batch_id, OWNER)))
    while todo:
        action = todo.pop(0)
        out.append(action)
        if isinstance(action, sm.Finish | sm.Fail | sm.Log | sm.CrashPoint):
            continue
        reply = answer(action)
        if reply is None:
            reply = _healthy(action, log, offsets, in_doubt or {}, stale or {}, results, m, todo)
        todo += m.handle(reply)
    return out


def _healthy(
    action: sm.Request,
    log: Sequence[msg.Payload],
    offsets: Iterator[int],
    in_doubt: Mapping[str, Sequence[PartId]],
    stale: Mapping[str, Sequence[PartId]],
    results: Sequence[TaskResult],
    m: DriverMachine,
    todo: list[sm.Action],
) -> sm.Event:
    if isinstance(action, sm.Fold):
        for payload in log:
            todo += m.handle(sm.Received(env(payload)))
        return sm.CaughtUp()
    if isinstance(action, sm.Publish):
        return sm.Published(env(action.payload), next(offsets), 1234)
    if isinstance(action, sm.ListInDoubt):
        return sm.Listed(tuple(in_doubt.get(action.sink, ())))
    if isinstance(action, sm.ListStale):
        return sm.Listed(tuple(stale.get(action.sink, ())))
    if isinstance(action, sm.RunTasks):
        return sm.TasksFinished(tuple(results))
    return sm.Done()


def resolved(actions: Sequence[sm.Action]) -> list[tuple[str, str, str, bool]]:
    return [
        (a.sink, a.part.token.split("~", 1)[1], a.outcome.value, a.decided)
        for a in actions
        if isinstance(a, sm.Resolve)
    ]


def published(actions: Sequence[sm.Action]) -> list[msg.Payload]:
    return [a.payload for a in actions if isinstance(a, sm.Publish)]


COMMITTED_1 = [
    msg.Prepare(1, 0),
    msg.Decision(1, msg.Outcome.COMMIT, parts=(msg.Part("spark-0.0.1", 0, SINKS),)),
]


def test_a_replay_applies_what_the_log_committed_and_judges_only_decided_parts() -> None:
    m = DriverMachine(PIPELINE, SINKS, checkpoint_every=20)
    actions = drive(
        m,
        0,
        [*COMMITTED_1, msg.Prepare(2, 0)],  # txn 1 committed, not COMPLETE; txn 2 undecided
        in_doubt={
            "a": [part(1, "spark-0.0.1"), part(1, "spark-0.0.9"), part(2, "spark-0.5.1")],
        },
    )
    assert published(actions) == [msg.Complete(1)]
    assert resolved(actions) == [
        ("a", "000000000001~spark-0.0.1", "commit", True),  # apply the pending commit
        ("b", "000000000001~spark-0.0.1", "commit", True),
        ("a", "000000000001~spark-0.0.1", "commit", True),  # decided and named
        ("a", "000000000001~spark-0.0.9", "abort", True),  # decided, not named
    ]  # txn 2 is undecided: only an attempt holding a tag may judge it
    assert not any(isinstance(a, sm.ListStale | sm.RunTasks) for a in actions)
    assert actions[-1] == sm.Finish(1, committed=False)


def test_an_attempt_aborts_older_attempts_and_leaves_other_writers_parts() -> None:
    m = DriverMachine(PIPELINE, SINKS, checkpoint_every=20)
    actions = drive(
        m,
        1,
        [*COMMITTED_1, msg.Complete(1)],
        in_doubt={"b": [part(2, "spark-0.4.7"), part(2, "someone-else")]},
        stale={"a": [part(1, "spark-1.0.3"), part(2, "spark-0.9.1"), part(2, "spark-0.11.0")]},
        results=[TaskResult(0, f"spark-0.{TAG}.0", 3, SINKS), TaskResult(1, None)],
    )
    assert resolved(actions) == [
        ("a", "000000000001~spark-1.0.3", "abort", False),  # open, of an earlier txn
        ("a", "000000000002~spark-0.9.1", "abort", False),  # open, of an older attempt
        ("b", "000000000002~spark-0.4.7", "abort", False),  # prepared by a dead attempt
        ("a", f"000000000002~spark-0.{TAG}.0", "commit", True),
        ("b", f"000000000002~spark-0.{TAG}.0", "commit", True),
    ]
    assert any(isinstance(a, sm.Log) and "not a Spark writer's" in a.message for a in actions)
    assert published(actions) == [
        msg.Prepare(2, 0),
        msg.Decision(2, msg.Outcome.COMMIT, parts=(msg.Part(f"spark-0.{TAG}.0", TAG, SINKS),)),
        msg.Complete(2),
    ]
    assert actions[-1] == sm.Finish(2, committed=True, rows=3, parts=1)


def test_a_newer_attempt_in_a_sink_means_this_driver_was_replaced() -> None:
    m = DriverMachine(PIPELINE, SINKS, checkpoint_every=20)
    actions = drive(
        m, 1, COMMITTED_1, in_doubt={"a": [part(2, "spark-0.4.0"), part(2, "spark-0.11.0")]}
    )
    fail = actions[-1]
    assert isinstance(fail, sm.Fail) and isinstance(fail.error, FencedError)
    assert "attempt 11 > 10" in str(fail.error)
    assert not any(isinstance(a, sm.RunTasks) for a in actions)
    assert m.fenced and m.view is None
    again = m.handle(sm.BatchCalled(1, OWNER))
    assert len(again) == 1 and isinstance(again[0], sm.Fail)
    assert "this writer was fenced" in str(again[0].error)


def _listings(*answers: Sequence[PartId]) -> Callable[[sm.Request], sm.Event | None]:
    """Answer the in-doubt listings in turn with ``answers`` (then nothing)."""
    it = iter(answers)
    return lambda r: sm.Listed(tuple(next(it, ()))) if isinstance(r, sm.ListInDoubt) else None


def test_a_refused_row_aborts_every_part_with_the_attempt_s_tag() -> None:
    m = DriverMachine(PIPELINE, ("a",), checkpoint_every=20)
    actions = drive(
        m,
        1,
        [*COMMITTED_1, msg.Complete(1)],
        results=[
            TaskResult(0, f"spark-0.{TAG}.0", 5, ("a",)),
            TaskResult(1, f"spark-1.{TAG}.1", 2, sink="a", error="bad amount", rejected=1),
        ],
        # Before the tasks: nothing. After: an unreported copy with our tag, another attempt's.
        answer=_listings((), (part(2, f"spark-0.{TAG}.7"), part(2, "spark-0.9.0"))),
    )
    fail = actions[-1]
    assert isinstance(fail, sm.Fail) and isinstance(fail.error, TwophaseBatchError)
    assert str(fail.error) == "batch 1 aborted: sink a rejected 1 row: bad amount"
    assert (fail.error.sink, fail.error.reason, fail.error.rejected) == ("a", "bad amount", 1)
    assert resolved(actions) == [
        ("a", f"000000000002~spark-0.{TAG}.0", "abort", False),
        ("a", f"000000000002~spark-0.{TAG}.7", "abort", False),
        ("a", f"000000000002~spark-1.{TAG}.1", "abort", False),
    ]
    assert published(actions) == [msg.Prepare(2, 0)], "an attempt that fails is never decided"


def test_a_task_failure_aborts_parts_only_the_sinks_know_of() -> None:
    m = DriverMachine(PIPELINE, ("a",), checkpoint_every=20)
    listed = _listings((), (part(2, f"spark-0.{TAG}.3"), part(2, "spark-0.9.0")))

    def answer(r: sm.Request) -> sm.Event | None:
        if isinstance(r, sm.RunTasks):
            return sm.TasksFailed("executor lost", RuntimeError("lost"))
        return listed(r)

    actions = drive(m, 1, [*COMMITTED_1, msg.Complete(1)], answer=answer)
    fail = actions[-1]
    assert isinstance(fail, sm.Fail) and isinstance(fail.cause, RuntimeError)
    assert str(fail.error) == "batch 1 aborted: a Spark task failed: executor lost"
    assert resolved(actions) == [("a", f"000000000002~spark-0.{TAG}.3", "abort", False)]


def test_a_fenced_decision_aborts_the_attempt_and_ends_the_writer() -> None:
    m = DriverMachine(PIPELINE, ("a",), checkpoint_every=20)
    actions = drive(
        m,
        1,
        [*COMMITTED_1, msg.Complete(1)],
        results=[TaskResult(0, f"spark-0.{TAG}.0", 5, ("a",))],
        answer=lambda r: (
            sm.Fenced("PRODUCER_FENCED")
            if isinstance(r, sm.Publish) and isinstance(r.payload, msg.Decision)
            else None
        ),
    )
    assert resolved(actions) == [("a", f"000000000002~spark-0.{TAG}.0", "abort", False)]
    fail = actions[-1]
    assert isinstance(fail, sm.Fail) and isinstance(fail.error, FencedError)
    assert "fenced while writing Decision" in str(fail.error)
    assert m.fenced


def test_a_fenced_prepare_touches_no_sink() -> None:
    m = DriverMachine(PIPELINE, SINKS, checkpoint_every=20)
    actions = drive(
        m, 1, COMMITTED_1, answer=lambda r: sm.Fenced("x") if isinstance(r, sm.Publish) else None
    )
    assert [type(a) for a in actions] == [sm.Fold, sm.Log, sm.Publish, sm.Fail]


def test_another_query_s_log_is_refused_and_not_taken_over() -> None:
    m = DriverMachine(PIPELINE, SINKS, checkpoint_every=20)
    assert m.handle(sm.BatchCalled(0, OWNER)) == [sm.Fold(OWNER)]
    assert m.handle(sm.Received(env(msg.Prepare(1, 0)))) == []
    refused = m.handle(sm.Received(env(msg.Prepare(2, 0), sender="coordinator:x")))
    assert len(refused) == 1 and isinstance(refused[0], sm.Fail)
    assert isinstance(refused[0].error, PipelineOwnerError)
    assert "written by coordinator:x, not by this query (spark:q1)" in str(refused[0].error)
    assert (m.owner, m.view, m.fenced) == ("", None, False)


def test_a_checkpoint_every_n_decisions_moves_where_readers_start() -> None:
    m = DriverMachine(PIPELINE, ("a",), checkpoint_every=2)
    actions = drive(m, 1, [*COMMITTED_1, msg.Complete(1)], results=[TaskResult(0, None)])
    assert published(actions)[-1] == msg.Checkpoint(2, (), ())
    assert actions[-2:] == [sm.CommitCheckpoint(TAG + 2), sm.Finish(2, committed=True)]
    assert m.decisions_since_checkpoint == 0
    # An empty batch publishes no COMPLETE: there is nothing to apply.
    assert [type(p) for p in published(actions)] == [msg.Prepare, msg.Decision, msg.Checkpoint]


def test_a_failed_call_drops_the_view_and_the_next_call_folds_again() -> None:
    m = DriverMachine(PIPELINE, SINKS, checkpoint_every=20)
    drive(m, 0, COMMITTED_1)
    assert m.view is not None
    assert isinstance(m.handle(sm.BatchCalled(1, OWNER))[0], sm.Publish)  # the view is kept
    assert m.handle(sm.Interrupted()) == []
    assert m.view is None
    assert m.handle(sm.BatchCalled(1, OWNER)) == [sm.Fold(OWNER)]


def test_an_answer_out_of_turn_is_a_bug_in_the_writer() -> None:
    m = DriverMachine(PIPELINE, SINKS, checkpoint_every=20)
    with pytest.raises(RuntimeError, match="no request is outstanding"):
        m.handle(sm.Done())
    m.handle(sm.BatchCalled(0, OWNER))
    with pytest.raises(RuntimeError, match="does not answer"):
        m.handle(sm.Done())
