"""The Spark driver's decisions as a pure state machine: events in, actions out, no I/O.

The writer (:mod:`twophase.participants.spark.writer`) calls it once per ``foreachBatch`` call
and does what it returns -- read the control log, publish, list and finish parts in the sinks,
run the executors' tasks -- feeding each outcome back as an event. The Spark simulator
(``tests/sim/spark_world.py``) drives the very same class, with crashes at every step, zombie
drivers and failing stores.

One batch ``batchId``, ``T = batchId + 1`` (``docs/spark.md`` has the tables)::

    fold the log tail (when the writer has no view, or the query changed)
    T <= last decided  -> replay: apply what is committed but not COMPLETE, finish decided
                          in-doubt parts, write nothing
    otherwise          -> PREPARE(T): its offset is the attempt's tag
                          apply what is pending; resolve in-doubt and stale parts by tag
                          run the tasks (each non-empty partition prepares one part)
                          a failure or a refused row -> abort this attempt's parts, raise
                          DECISION(T, commit, parts) -- the commit point
                          commit every part, COMPLETE(T), CHECKPOINT when due

Each call is a queue of steps. A step is an action for the writer or a continuation that
plans the next steps from the answer to the last request. The writer runs one request at a
time (:data:`Request`) and answers it with exactly one event; :class:`Fold` is answered by
any number of :class:`Received` and one :class:`CaughtUp`. Notices (:class:`Log`,
:class:`CrashPoint`) need no answer; :class:`Finish` and :class:`Fail` end the call.

The machine never waits, sleeps or retries: how long a sink call is retried is the writer's
business (:class:`Resolve` says only whether the log decided the part).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from twophase.errors import AbortError, FatalError, FencedError
from twophase.participants.sdk import PartId
from twophase.protocol.logview import LogView
from twophase.protocol.messages import (
    Checkpoint,
    Complete,
    Decision,
    Envelope,
    Outcome,
    Part,
    Payload,
    Prepare,
)

__all__ = [
    "Action",
    "BatchCalled",
    "CaughtUp",
    "CommitCheckpoint",
    "CrashPoint",
    "Done",
    "DriverMachine",
    "Event",
    "Fail",
    "Fenced",
    "Finish",
    "Fold",
    "Interrupted",
    "ListInDoubt",
    "ListStale",
    "Listed",
    "Log",
    "PipelineOwnerError",
    "Publish",
    "Published",
    "Received",
    "Request",
    "Resolve",
    "RunTasks",
    "TaskResult",
    "TasksFailed",
    "TasksFinished",
    "TwophaseBatchError",
    "batch_error",
    "tag_of",
]


class TwophaseBatchError(AbortError):
    """A micro-batch was aborted as a whole: nothing of it is visible in any sink.

    ``sink`` and ``reason`` name the first sink that refused and why (empty when a Spark task
    failed outside the sinks); ``rejected`` counts the rows sinks refused.
    """

    def __init__(
        self,
        batch_id: int,
        txn: int,
        details: str,
        *,
        sink: str = "",
        reason: str = "",
        rejected: int = 0,
    ) -> None:
        super().__init__(f"batch {batch_id} aborted: {details}")
        self.batch_id = batch_id
        self.txn = txn
        self.sink = sink
        self.reason = reason
        self.rejected = rejected


class PipelineOwnerError(FatalError):
    """The pipeline's control log was written by another streaming query (or by a coordinator).

    ``T = batchId + 1`` only means something for the query whose checkpoint numbers the batches:
    another query's batch 3 would look "already committed" and be skipped.
    """


@dataclass(frozen=True, slots=True)
class TaskResult:
    """What one task sends back to the driver: counts and names, never rows."""

    partition: int
    participant: str | None  # None: an empty partition, no part was begun
    rows: int = 0
    sinks: tuple[str, ...] = ()
    sink: str = ""  # the sink that refused or failed
    error: str = ""
    rejected: int = 0


# -- events ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchCalled:
    """``foreachBatch`` called the writer; ``owner`` is ``spark:<query id>``."""

    batch_id: int
    owner: str


@dataclass(frozen=True, slots=True)
class Received:
    """One message of the log tail (answers :class:`Fold`)."""

    env: Envelope


@dataclass(frozen=True, slots=True)
class CaughtUp:
    """The log tail is read (ends :class:`Fold`)."""


@dataclass(frozen=True, slots=True)
class Published:
    """The message is in the log at ``offset``, written ``now_ms`` (answers :class:`Publish`)."""

    env: Envelope
    offset: int
    now_ms: int


@dataclass(frozen=True, slots=True)
class Fenced:
    """Kafka refused the write: a newer holder of the transactional id took over."""

    reason: str


@dataclass(frozen=True, slots=True)
class Listed:
    """A sink's parts (answers :class:`ListInDoubt` and :class:`ListStale`)."""

    parts: tuple[PartId, ...]


@dataclass(frozen=True, slots=True)
class Done:
    """The call asked for went through (answers :class:`Resolve` and :class:`CommitCheckpoint`)."""


@dataclass(frozen=True, slots=True)
class TasksFinished:
    results: tuple[TaskResult, ...]


@dataclass(frozen=True, slots=True)
class TasksFailed:
    """A Spark task failed outside the sinks (the job was cancelled, an executor was lost)."""

    reason: str
    cause: BaseException | None = None


@dataclass(frozen=True, slots=True)
class Interrupted:
    """A request raised, and the writer lets the error end the call: the view is dropped, the
    next call folds the log again (the log is the truth)."""


Event = (
    BatchCalled
    | Received
    | CaughtUp
    | Published
    | Fenced
    | Listed
    | Done
    | TasksFinished
    | TasksFailed
    | Interrupted
)

# -- actions -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fold:
    """Read the control log from the latest checkpoint: :class:`Received` per message, then
    :class:`CaughtUp`. Stop reading when an answer is :class:`Fail`."""

    owner: str


@dataclass(frozen=True, slots=True)
class Publish:
    """Write ``payload`` (sender: the machine's owner) in its own Kafka transaction."""

    payload: Payload


@dataclass(frozen=True, slots=True)
class ListInDoubt:
    """``Sink.in_doubt()`` of sink ``sink``."""

    sink: str


@dataclass(frozen=True, slots=True)
class ListStale:
    """``Sink.stale_parts(before_txn)`` of sink ``sink``."""

    sink: str
    before_txn: int


@dataclass(frozen=True, slots=True)
class Resolve:
    """Commit or abort ``part`` in sink ``sink`` (both idempotent). ``decided``: the log decided
    it, so it is worth waiting for; otherwise it is a dead attempt's clean-up."""

    sink: str
    part: PartId
    outcome: Outcome
    decided: bool


@dataclass(frozen=True, slots=True)
class RunTasks:
    """Write the batch on the executors: one part per non-empty partition, named
    ``spark-<partition>.<tag>.<task attempt>``, prepared in every sink; records stamped
    ``started_ms`` (when the attempt opened)."""

    batch_id: int
    txn: int
    tag: int
    started_ms: int


@dataclass(frozen=True, slots=True)
class CommitCheckpoint:
    """Point the coordinator group's offset on the control partition at the CHECKPOINT just
    written: every reader of the log starts there."""

    offset: int


@dataclass(frozen=True, slots=True)
class Log:
    level: str  # "info" | "warning"
    message: str
    txn: int = 0


@dataclass(frozen=True, slots=True)
class CrashPoint:
    """Fault injection: the tests kill the driver here (:func:`twophase.faults.crash_point`)."""

    name: str


@dataclass(frozen=True, slots=True)
class Finish:
    """The call returns. ``committed``: it wrote and committed the batch (``rows`` in
    ``parts``); otherwise it was a replay that only applied what the log holds."""

    txn: int
    committed: bool
    rows: int = 0
    parts: int = 0


@dataclass(frozen=True, slots=True)
class Fail:
    """The call raises ``error`` (``from cause``). A :class:`FencedError` ends the writer."""

    error: Exception
    cause: BaseException | None = None


Request = Fold | Publish | ListInDoubt | ListStale | Resolve | RunTasks | CommitCheckpoint
Action = Request | Log | CrashPoint | Finish | Fail

#: What each request is answered with (beside Interrupted, which may answer any).
_ANSWERS: dict[type, tuple[type, ...]] = {
    Fold: (Received, CaughtUp),
    Publish: (Published, Fenced),
    ListInDoubt: (Listed,),
    ListStale: (Listed,),
    Resolve: (Done,),
    RunTasks: (TasksFinished, TasksFailed),
    CommitCheckpoint: (Done,),
}

_Step = Action | Callable[[], None]


def tag_of(part: PartId) -> int | None:
    """The attempt tag in ``spark-<partition>.<tag>.<task>``; None for other names."""
    pieces = part.participant.split(".")
    if len(pieces) != 3 or not pieces[0].startswith("spark-") or not pieces[1].isdigit():
        return None
    return int(pieces[1])


def batch_error(batch_id: int, txn: int, failed: Sequence[TaskResult]) -> TwophaseBatchError:
    """One message naming every sink that refused, with the first reason of each."""
    by_sink: dict[str, list[TaskResult]] = {}
    for r in failed:
        by_sink.setdefault(r.sink, []).append(r)
    details = []
    for sink, results in by_sink.items():
        rejected = sum(r.rejected for r in results)
        name = f"sink {sink}" if sink else "a task"
        if rejected:
            rows = "row" if rejected == 1 else "rows"
            details.append(f"{name} rejected {rejected} {rows}: {results[0].error}")
        else:
            details.append(f"{name} failed: {results[0].error}")
    first = failed[0]
    return TwophaseBatchError(
        batch_id,
        txn,
        "; ".join(details),
        sink=first.sink,
        reason=first.error,
        rejected=sum(r.rejected for r in failed),
    )


@dataclass(slots=True)
class _Attempt:
    """One attempt at a batch: opened by its PREPARE, whose offset is ``tag``."""

    batch_id: int
    txn: int
    tag: int
    started_ms: int
    results: tuple[TaskResult, ...] = ()


@dataclass(slots=True)
class _Call:
    """One ``foreachBatch`` call in progress."""

    batch_id: int
    txn: int
    owner: str
    steps: deque[_Step] = field(default_factory=deque)
    waiting: Request | None = None
    answer: Event | None = None
    attempt: _Attempt | None = None
    #: The fold in progress: the view being built, and decisions since its last checkpoint.
    folding: LogView | None = None
    fold_decisions: int = 0


class DriverMachine:
    """One per writer. ``sinks`` are the pipeline's sink names, in config order;
    ``control_topic`` only names the log in messages."""

    def __init__(
        self,
        pipeline: str,
        sinks: Sequence[str],
        checkpoint_every: int,
        *,
        control_topic: str = "",
    ) -> None:
        self.pipeline = pipeline
        self.sinks = tuple(sinks)
        self.checkpoint_every = checkpoint_every
        self.control_topic = control_topic or f"twophase.control.{pipeline}"
        #: Set by a FencedError: a newer driver took over, and this writer never writes again.
        self.fenced = False
        #: The query whose log the view holds (the sender of everything the writer publishes).
        self.owner = ""
        #: The control log as folded; None until the first fold and after any failed call.
        self.view: LogView | None = None
        self.decisions_since_checkpoint = 0
        self._call: _Call | None = None

    # -- the one entry point -------------------------------------------------------------------

    def handle(self, event: Event) -> list[Action]:
        if isinstance(event, BatchCalled):
            return self._start(event)
        call = self._call
        if isinstance(event, Interrupted):
            self._end(failed=True)
            return []
        if call is None or call.waiting is None:
            raise RuntimeError(f"{type(event).__name__} while no request is outstanding")
        if not isinstance(event, _ANSWERS[type(call.waiting)]):
            raise RuntimeError(f"{type(event).__name__} does not answer {call.waiting}")
        if isinstance(event, Received):
            return self._on_received(call, event)
        if isinstance(event, Fenced):
            return self._on_fenced(call, event)
        if isinstance(event, CaughtUp):
            self._caught_up(call)
        elif isinstance(event, Published):
            assert self.view is not None
            self.view.apply(event.env)
        call.waiting = None
        call.answer = event
        return self._advance(call)

    # -- the step queue ------------------------------------------------------------------------

    def _next(self, *steps: _Step) -> None:
        """Run ``steps`` before anything already planned."""
        assert self._call is not None
        self._call.steps.extendleft(reversed(steps))

    def _advance(self, call: _Call) -> list[Action]:
        """Run continuations and hand out actions up to the next request or the call's end."""
        out: list[Action] = []
        while call.steps and self._call is call:
            step = call.steps.popleft()
            if callable(step):
                step()
                continue
            out.append(step)
            if isinstance(step, Finish):
                self._end(failed=False)
            elif isinstance(step, Fail):
                self.fenced = self.fenced or isinstance(step.error, FencedError)
                self._end(failed=True)
            elif not isinstance(step, Log | CrashPoint):
                call.waiting = step
                break
        return out

    def _end(self, *, failed: bool) -> None:
        self._call = None
        if failed:
            self.view = None  # whatever failed, the next call starts from a fresh fold

    def _answer(self) -> Event:
        assert self._call is not None and self._call.answer is not None
        return self._call.answer

    # -- the call ------------------------------------------------------------------------------

    def _start(self, event: BatchCalled) -> list[Action]:
        if self._call is not None:
            self._end(failed=True)  # the writer dropped a call without saying: start afresh
        if self.fenced:
            return [
                Fail(
                    FencedError(
                        f"pipeline {self.pipeline}: this writer was fenced by a newer driver"
                    )
                )
            ]
        call = _Call(event.batch_id, event.batch_id + 1, event.owner)
        self._call = call
        if self.view is None or event.owner != self.owner:
            call.folding = LogView()
            self._next(Fold(event.owner), self._begin)
        else:
            self._next(self._begin)
        return self._advance(call)

    def _on_received(self, call: _Call, event: Received) -> list[Action]:
        view = call.folding
        assert view is not None
        env = event.env
        if env.sender != call.owner:
            self._end(failed=True)
            return [
                Fail(
                    PipelineOwnerError(
                        f"pipeline {self.pipeline}: its control log ({self.control_topic}) was "
                        f"written by {env.sender}, not by this query ({call.owner}). Batch ids "
                        "number transactions only within one query's checkpoint: give a new "
                        "query (or a new checkpoint) a pipeline of its own"
                    )
                )
            ]
        if not view.apply(env):
            return [
                Log(
                    "warning",
                    f"pipeline {self.pipeline}: skipping control message: out_of_sequence: "
                    f"{view.why_out_of_sequence(env)}",
                )
            ]
        if isinstance(env.payload, Checkpoint):
            call.fold_decisions = 0
        elif isinstance(env.payload, Decision):
            call.fold_decisions += 1
        return []

    def _caught_up(self, call: _Call) -> None:
        view = call.folding
        assert view is not None
        self.view, call.folding = view, None
        self.owner = call.owner
        self.decisions_since_checkpoint = call.fold_decisions
        self._next(
            Log(
                "info",
                f"pipeline {self.pipeline}: log folded, last committed txn {view.last_decided}, "
                f"{len(view.pending)} pending",
            )
        )

    def _begin(self) -> None:
        call = self._call
        assert call is not None and self.view is not None
        if call.txn <= self.view.last_decided:
            # Spark re-runs a batch that is already committed: apply what may be missing.
            self._next(
                Log(
                    "info",
                    f"batch {call.batch_id} is a replay of a committed batch: applying, not "
                    "writing",
                    call.txn,
                ),
                *self._apply_pending(),
                *self._resolve_in_doubt(None),
                Finish(call.txn, committed=False),
            )
        else:
            # The fenced write that opens the attempt; its offset is the attempt's tag.
            self._next(Publish(Prepare(call.txn, deadline_ms=0)), self._opened)

    def _opened(self) -> None:
        call = self._call
        answer = self._answer()
        assert call is not None and isinstance(answer, Published)
        attempt = _Attempt(call.batch_id, call.txn, answer.offset, answer.now_ms)
        call.attempt = attempt
        self._next(
            *self._apply_pending(),
            *self._resolve_in_doubt(attempt.tag),
            RunTasks(attempt.batch_id, attempt.txn, attempt.tag, attempt.started_ms),
            self._ran,
        )

    def _ran(self) -> None:
        call = self._call
        answer = self._answer()
        assert call is not None and call.attempt is not None
        attempt = call.attempt
        if isinstance(answer, TasksFailed):
            error = TwophaseBatchError(
                attempt.batch_id, attempt.txn, f"a Spark task failed: {answer.reason}"
            )
            self._next(*self._abort_attempt(attempt), Fail(error, answer.cause))
            return
        assert isinstance(answer, TasksFinished)
        attempt.results = answer.results
        failed = [r for r in answer.results if r.error]
        if failed:
            error = batch_error(attempt.batch_id, attempt.txn, failed)
            self._next(*self._abort_attempt(attempt), Fail(error))
            return
        prepared = [r for r in answer.results if r.participant is not None]
        decision = Decision(
            attempt.txn,
            Outcome.COMMIT,
            parts=tuple(Part(r.participant or "", attempt.tag, r.sinks) for r in prepared),
        )
        finish = Finish(
            attempt.txn, committed=True, rows=sum(r.rows for r in prepared), parts=len(prepared)
        )
        self._next(
            CrashPoint("spark_after_prepare"),
            Publish(decision),  # the commit point
            CrashPoint("spark_after_decision"),
            *self._apply(attempt.txn, decision.parts),
            *([Publish(Complete(attempt.txn))] if decision.parts else []),
            self._checkpoint_if_due,
            finish,
        )

    def _on_fenced(self, call: _Call, event: Fenced) -> list[Action]:
        assert call.waiting is not None and isinstance(call.waiting, Publish)
        payload = call.waiting.payload
        call.waiting = None
        self.fenced = True
        error = FencedError(
            f"pipeline {self.pipeline}: fenced while writing {type(payload).__name__}: another "
            f"driver took over ({event.reason})"
        )
        call.steps.clear()
        if isinstance(payload, Decision) and call.attempt is not None:
            # Only this attempt could have committed its parts: nobody else will.
            self._next(*self._abort_attempt(call.attempt), Fail(error))
        else:
            self._next(Fail(error))
        return self._advance(call)

    # -- applying ------------------------------------------------------------------------------

    def _apply(self, txn: int, parts: Sequence[Part]) -> list[_Step]:
        """Commit every part of a committed transaction in every sink it names."""
        steps: list[_Step] = []
        for i, sink in enumerate(self.sinks):
            steps += [
                Resolve(
                    sink, PartId(self.pipeline, txn, part.participant), Outcome.COMMIT, decided=True
                )
                for part in parts
                if sink in part.sinks
            ]
            if i == 0:
                steps.append(CrashPoint("spark_mid_apply"))
        steps.append(Log("info", f"applied: {len(parts)} parts", txn))
        return steps

    def _apply_pending(self) -> list[_Step]:
        """Apply every committed transaction whose COMPLETE is missing (a crash mid-apply)."""
        assert self.view is not None
        steps: list[_Step] = []
        for txn, pending in sorted(self.view.pending.items()):
            steps += self._apply(txn, tuple(pending.parts.values()))
            steps.append(Publish(Complete(txn)))
        return steps

    def _checkpoint_if_due(self) -> None:
        assert self.view is not None
        self.decisions_since_checkpoint += 1
        if self.decisions_since_checkpoint >= self.checkpoint_every:
            self._next(Publish(self.view.checkpoint()), self._checkpointed)

    def _checkpointed(self) -> None:
        answer = self._answer()
        assert isinstance(answer, Published)
        # Readers start at the latest checkpoint. Losing this commit only lengthens the tail.
        self._next(CommitCheckpoint(answer.offset), self._checkpoint_committed)

    def _checkpoint_committed(self) -> None:
        self.decisions_since_checkpoint = 0

    # -- in-doubt parts ------------------------------------------------------------------------

    def _resolve_in_doubt(self, tag: int | None) -> list[_Step]:
        """Finish what earlier attempts left in the sinks (the table in ``docs/spark.md``).
        ``tag`` None (a replay): only parts the log decided."""
        assert self._call is not None
        steps: list[_Step] = []
        for sink in self.sinks:
            steps += [ListInDoubt(sink), _bind(self._judge_in_doubt, sink, tag)]
            if tag is not None:
                steps += [ListStale(sink, self._call.txn + 1), _bind(self._judge_stale, sink, tag)]
        return steps

    def _judge_in_doubt(self, sink: str, tag: int | None) -> None:
        answer = self._answer()
        assert isinstance(answer, Listed) and self.view is not None
        view = self.view
        steps: list[_Step] = []
        for part in answer.parts:
            if part.txn <= view.last_decided:
                outcome = view.outcome_of(part.txn, part.participant) or Outcome.ABORT
                steps += [
                    Log(
                        "info",
                        f"part {part.participant} in {sink}: {outcome.value} (decided)",
                        part.txn,
                    ),
                    Resolve(sink, part, outcome, decided=True),
                ]
                continue
            if tag is None:
                continue  # undecided: only an attempt holding a tag may judge it
            other = tag_of(part)
            if other is None:
                steps.append(
                    Log(
                        "warning",
                        f"sink {sink}: ignoring prepared part {part.token} (not a Spark writer's)",
                    )
                )
            elif other < tag:
                steps += [
                    Log(
                        "info",
                        f"part {part.participant} in {sink}: abort (dead attempt {other})",
                        part.txn,
                    ),
                    Resolve(sink, part, Outcome.ABORT, decided=False),
                ]
            elif other > tag:
                steps.append(
                    Fail(
                        FencedError(
                            f"pipeline {self.pipeline}: sink {sink} holds part {part.token} of "
                            f"a newer driver (attempt {other} > {tag}); this driver was replaced"
                        )
                    )
                )
                break
        self._next(*steps)

    def _judge_stale(self, sink: str, tag: int) -> None:
        """Open parts a dead writer left: earlier transactions, or this one's older attempts."""
        answer = self._answer()
        call = self._call
        assert isinstance(answer, Listed) and call is not None
        self._next(
            *(
                Resolve(sink, part, Outcome.ABORT, decided=False)
                for part in answer.parts
                if part.txn < call.txn or ((other := tag_of(part)) is not None and other < tag)
            )
        )

    def _abort_attempt(self, attempt: _Attempt) -> list[_Step]:
        """Abort every part the attempt may have left: reported ones, and any with its tag."""
        known = {r.participant for r in attempt.results if r.participant is not None}
        steps: list[_Step] = []
        for sink in self.sinks:
            names = set(known)
            steps += [
                ListInDoubt(sink),
                _bind(self._collect_attempt, attempt, names),
                ListStale(sink, attempt.txn + 1),
                _bind(self._collect_attempt, attempt, names),
                _bind(self._abort_named, sink, attempt, names),
            ]
        steps.append(
            Log("warning", f"batch {attempt.batch_id} aborted (attempt {attempt.tag})", attempt.txn)
        )
        return steps

    def _collect_attempt(self, attempt: _Attempt, names: set[str]) -> None:
        answer = self._answer()
        assert isinstance(answer, Listed)
        names.update(
            p.participant for p in answer.parts if p.txn == attempt.txn and tag_of(p) == attempt.tag
        )

    def _abort_named(self, sink: str, attempt: _Attempt, names: set[str]) -> None:
        self._next(
            *(
                Resolve(
                    sink, PartId(self.pipeline, attempt.txn, name), Outcome.ABORT, decided=False
                )
                for name in sorted(names)
            )
        )


def _bind(fn: Callable[..., None], *args: object) -> Callable[[], None]:
    """A continuation: ``fn(*args)`` when the queue reaches it."""
    return lambda: fn(*args)
