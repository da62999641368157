"""A deterministic simulator for the Spark driver's state machine.

One ``random.Random(seed)`` drives everything: which driver or task moves next, crashes, zombie
drivers, failing stores, lost executors, refused rows, speculative tasks. The very machine the
coordinated writer runs (:class:`twophase.participants.spark.machine.DriverMachine`) is driven
the way :mod:`twophase.participants.spark.writer` drives it; Kafka, Spark and the sinks are
small in-memory models.

A run has two phases. The *fault* phase runs the query with faults switched on. The
*quiescence* phase switches them off, kills every zombie driver and leftover task, adds one
more batch, and runs the query until every batch is committed. Then the guarantees of
``DESIGN.md`` are checked against the stores and the whole control log.

Reproduce one schedule exactly, with a trace of every step::

    .venv/bin/python -m tests.sim.spark_world --seed 1234 --verbose   # from the repository root

What is modelled
----------------
* The control topic: one ordered log. Each write is one Kafka transaction checked against the
  producer epoch: a writer created later (``init_transactions``) fences every earlier one, whose
  writes then fail (:class:`Fenced`) and land nothing. A write may also fail without landing, or
  land while the writer sees an error (an unknown outcome). Readers start at the coordinator
  group's offset (the latest CHECKPOINT whose offset commit went through) and may read a message
  twice.
* Spark: the query's checkpoint (the last batch whose ``foreachBatch`` returned). A failed call
  fails the query; it restarts with the same writer or, as a new process, with a new one. The
  driver's process may die at any step (and its executors with it), most often at the crash
  points. A second driver may start while the first is mid-batch; the first becomes a zombie that
  finishes its call (and may start another) until it learns it is fenced.
* Tasks: one per partition of the batch, each a sequence of sink calls (begin and write, then
  prepare, per sink) that interleave with everything else. An executor may be lost at any call
  (Spark retries the task under a new attempt id, up to four times, then fails the job); a sink
  may refuse a row (the task aborts its part and reports the refusal); a speculative copy may run
  beside a task, and the copy whose result Spark did not keep runs on, detached, for a while.
  Task attempt ids restart at 0 in every driver process, as Spark's do.
* Sinks: stores with the SDK's semantics. Two keep open parts as markers (MongoDB, files:
  ``stale_parts`` lists them); one drops a part's open transaction with its writer
  (PostgreSQL: ``stale_parts`` is empty) and has row locks: a task cannot write a partition of
  a batch while a part of the same partition and batch is prepared there (it gives up). Any listing, commit or abort may fail (the writer's
  retry budget ran out): the call ends with that error. Misuse of the SDK contract by the
  machine is a violation.

What is not modelled: real time and retry budgets, rows (a part holds its partition's row
count), Spark's own checkpoint failures, a query moved to another pipeline.
"""

from __future__ import annotations

import random
import sys
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from twophase.errors import FencedError, RetriableError
from twophase.participants.sdk import PartId
from twophase.participants.spark import machine as sm
from twophase.participants.spark.machine import tag_of
from twophase.protocol.logview import LogView
from twophase.protocol.messages import Decision, Envelope, Outcome, Payload, Prepare

from . import seeds

__all__ = ["Params", "Result", "SimViolation", "World", "run"]

PIPELINE = "sim"
OWNER = "spark:query-1"
STORES = ("mongo", "files", "pg")
#: Stores that drop an unprepared part with its writer's connection (like PostgreSQL).
DROPS_OPEN = ("pg",)
#: Spark fails the job after this many failures of one task (``spark.task.maxFailures``).
MAX_TASK_FAILURES = 4

OPEN, PREPARED, COMMITTED, ABORTED = "open", "prepared", "committed", "aborted"


class SimViolation(AssertionError):
    """A guarantee, or the sink contract, was broken."""


class _IOFailure(Exception):
    """A store or Kafka call raised; the writer lets it end the call."""


@dataclass(frozen=True, slots=True)
class Params:
    """Everything a schedule depends on, drawn from the seed (so the seed alone reproduces it)."""

    batches: int
    partitions: int
    checkpoint_every: int
    fault_steps: int
    p_crash: float  # per step: the live driver's process dies
    p_crash_point: float  # at each crash point
    p_zombie: float  # per step while the live driver is in a call: a second driver starts
    p_io_fail: float  # a sink listing, commit or abort, or an offset commit, raises
    p_publish_fail: float  # a control-topic write raises (half of those landed anyway)
    p_task_lost: float  # per sink call of a task: the executor is lost
    p_reject: float  # per write of a task: a sink refuses a row
    p_speculate: float  # per task: a speculative copy runs beside it
    p_dup: float  # per message read in a fold: read twice
    p_same_writer: float  # a failed call is retried by the same writer (else a new process)

    @classmethod
    def draw(cls, rng: random.Random) -> Params:
        return cls(
            batches=rng.randint(3, 8),
            partitions=rng.randint(1, 4),
            checkpoint_every=rng.randint(1, 4),
            fault_steps=rng.randint(100, 600),
            p_crash=rng.choice([0.0, 0.003, 0.01]),
            p_crash_point=rng.choice([0.0, 0.1, 0.3]),
            p_zombie=rng.choice([0.0, 0.005, 0.02]),
            p_io_fail=rng.choice([0.0, 0.01, 0.05]),
            p_publish_fail=rng.choice([0.0, 0.02, 0.08]),
            p_task_lost=rng.choice([0.0, 0.02, 0.08]),
            p_reject=rng.choice([0.0, 0.01, 0.05]),
            p_speculate=rng.choice([0.0, 0.2, 0.5]),
            p_dup=rng.choice([0.0, 0.1]),
            p_same_writer=rng.choice([0.0, 0.5, 1.0]),
        )

    @classmethod
    def calm(cls, **kw: float) -> Params:
        """No random faults: for hand-written scenarios, which place their own."""
        base = cls(
            batches=4,
            partitions=2,
            checkpoint_every=2,
            fault_steps=0,
            p_crash=0.0,
            p_crash_point=0.0,
            p_zombie=0.0,
            p_io_fail=0.0,
            p_publish_fail=0.0,
            p_task_lost=0.0,
            p_reject=0.0,
            p_speculate=0.0,
            p_dup=0.0,
            p_same_writer=1.0,
        )
        return replace(base, **kw)


# -- the stores ---------------------------------------------------------------------------------


@dataclass(slots=True)
class StorePart:
    state: str
    rows: int
    task: TaskAttempt | None  # the task attempt writing it, while it is open


class Store:
    def __init__(self, world: World, name: str) -> None:
        self.world = world
        self.name = name
        self.drops_open = name in DROPS_OPEN
        self.parts: dict[PartId, StorePart] = {}

    def _violation(self, what: str) -> SimViolation:
        return SimViolation(f"sink {self.name}: {what}")

    # Executors' calls.

    def begin(self, part: PartId, rows: int, task: TaskAttempt) -> bool:
        """False when the write waits for a lock until the task gives up: a store with row
        locks (PostgreSQL) holds the batch's keys for a prepared part of the same partition."""
        if part in self.parts:
            raise self._violation(f"begin of {part.token}, which exists: part ids must be unique")
        if self.drops_open and any(
            p.txn == part.txn and _partition(p) == _partition(part) and sp.state == PREPARED
            for p, sp in self.parts.items()
        ):
            return False
        self.parts[part] = StorePart(OPEN, rows, task)
        return True

    def prepare(self, part: PartId) -> bool:
        """False when the part is gone or aborted (the task's prepare fails)."""
        sp = self.parts.get(part)
        if sp is None or sp.state == ABORTED:
            return False
        if sp.state != OPEN:
            raise self._violation(f"prepare of {part.token}, which is {sp.state}")
        sp.state, sp.task = PREPARED, None
        return True

    def writer_gone(self, part: PartId) -> None:
        """The task writing ``part`` ended: a store that drops open parts with their
        connection rolls it back."""
        sp = self.parts.get(part)
        if sp is not None and sp.state == OPEN:
            sp.task = None
            if self.drops_open:
                del self.parts[part]

    # The driver's calls.

    def commit(self, part: PartId) -> None:
        sp = self.parts.get(part)
        if sp is None or sp.state not in (PREPARED, COMMITTED):
            state = sp.state if sp is not None else "missing"
            raise self._violation(f"commit of {part.token}, which is {state}")
        sp.state = COMMITTED

    def abort(self, part: PartId) -> None:
        sp = self.parts.get(part)
        if sp is None or sp.state == ABORTED:
            return
        if sp.state == COMMITTED:
            raise self._violation(f"abort of {part.token}, which is committed")
        sp.state = ABORTED

    def in_doubt(self) -> tuple[PartId, ...]:
        return tuple(sorted(p for p, sp in self.parts.items() if sp.state == PREPARED))

    def stale_parts(self, before_txn: int) -> tuple[PartId, ...]:
        if self.drops_open:
            return ()
        return tuple(
            sorted(p for p, sp in self.parts.items() if sp.state == OPEN and p.txn < before_txn)
        )


# -- Spark's tasks ------------------------------------------------------------------------------


@dataclass(slots=True)
class TaskAttempt:
    """One attempt of one task: sink calls left to make, one per step."""

    job: TaskJob
    partition: int
    participant: str
    steps: deque[tuple[str, str]]  # (begin|prepare, store)
    begun: list[str] = field(default_factory=list)
    detached: bool = False  # Spark no longer waits for it (a speculative copy that lost)

    @property
    def part(self) -> PartId:
        return PartId(PIPELINE, self.job.txn, self.participant)


@dataclass(slots=True)
class TaskJob:
    """A RunTasks in progress: the batch's tasks, one per partition."""

    driver: Driver
    batch_id: int
    txn: int
    tag: int
    results: dict[int, sm.TaskResult] = field(default_factory=dict)
    failures: Counter[int] = field(default_factory=Counter)
    failed: str = ""

    @property
    def done(self) -> bool:
        return bool(self.failed) or len(self.results) == self.driver.world.p.partitions


# -- drivers ------------------------------------------------------------------------------------


class Driver:
    """One driver process: a writer (the machine), its Spark query loop, its executors."""

    def __init__(self, world: World, number: int) -> None:
        self.world = world
        self.name = f"driver{number}"
        world.epoch += 1  # init_transactions: every earlier writer is fenced from now on
        self.epoch = world.epoch
        self.machine = sm.DriverMachine(PIPELINE, STORES, world.p.checkpoint_every)
        self.alive = True
        self.zombie = False
        self.zombie_calls = 0
        self.actions: deque[sm.Action] = deque()
        self.batch = -1
        self.in_call = False
        self.fold: deque[Envelope] | None = None
        self.job: TaskJob | None = None
        self.next_task_attempt = 0  # Spark numbers task attempts from 0 in every application
        self.errors: list[Exception] = []

    def __repr__(self) -> str:
        return f"{self.name}(epoch {self.epoch}{', zombie' if self.zombie else ''})"


@dataclass
class Result:
    seed: int
    ok: bool
    error: str
    steps: int
    batches: int
    drivers: int
    trace: list[str]

    def summary(self) -> str:
        return f"after {self.steps} steps: {self.batches} batches, {self.drivers} drivers"


class World:
    def __init__(
        self, seed: int, verbose: bool = False, wire: bool = False, params: Params | None = None
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.p = params or Params.draw(self.rng)
        self.verbose = verbose
        self.wire = wire
        self.faults = True
        self.batches = self.p.batches
        self.rows: list[list[int]] = []
        self._add_batches(self.batches)
        self.log: list[tuple[int, Envelope]] = []  # (writer's epoch, message)
        self.group_offset = 0
        self.epoch = 0
        self.stores = {name: Store(self, name) for name in STORES}
        #: Spark's checkpoint: the last batch whose foreachBatch call returned.
        self.spark_committed = -1
        self.drivers: list[Driver] = []
        self.tasks: list[TaskAttempt] = []
        self.steps = 0
        self.lines: list[str] = []
        #: Hand-written scenarios: called before each action a driver takes; answers "crash"
        #: (the driver dies instead), "fail" (its call raises instead) or None.
        self.before_action: Callable[[Driver, sm.Action], str | None] | None = None
        #: Hand-written scenarios: drivers that, with their tasks, do not move for now.
        self.held: list[Driver] = []
        self.live = self.new_driver()

    # -- the trace --

    def trace(self, line: str) -> None:
        if self.verbose:
            self.lines.append(f"[{self.steps:5d}] {line}")

    def _add_batches(self, n: int) -> None:
        for _ in range(n):
            # Rows per partition; empty partitions are common in small micro-batches.
            self.rows.append(
                [self.rng.choice([0, 0, 1, 2, 3, 5]) for _ in range(self.p.partitions)]
            )

    # -- drivers --

    def new_driver(self) -> Driver:
        d = Driver(self, len(self.drivers) + 1)
        self.drivers.append(d)
        self.live = d
        self.trace(f"{d} starts: init_transactions, epoch {d.epoch}")
        return d

    def crash(self, d: Driver) -> None:
        """SIGKILL: the process and its executors are gone; what they wrote stays."""
        self.trace(f"{d} CRASHES")
        d.alive = False
        for t in [t for t in self.tasks if t.job.driver is d]:
            self._end_task(t)
        if d is self.live:
            self.new_driver()

    def start_zombie(self) -> None:
        """A second driver of the pipeline starts while the live one is mid-batch."""
        old = self.live
        old.zombie = True
        old.zombie_calls = self.rng.randint(0, 2)
        self.trace(f"{old} becomes a zombie")
        self.new_driver()

    def call(self, d: Driver, batch_id: int) -> None:
        d.batch, d.in_call = batch_id, True
        self.trace(f"{d} foreachBatch({batch_id})")
        d.actions.extend(d.machine.handle(sm.BatchCalled(batch_id, OWNER)))

    def answer(self, d: Driver, event: sm.Event) -> None:
        d.actions.extend(d.machine.handle(event))

    def end_call(self, d: Driver, error: Exception | None) -> None:
        d.in_call = False
        if error is None:
            self.trace(f"{d} foreachBatch({d.batch}) returns")
            if d is self.live:
                if d.batch != self.spark_committed + 1:
                    raise SimViolation(f"Spark ran batch {d.batch} after {self.spark_committed}")
                self.spark_committed = d.batch
            return
        self.trace(f"{d} foreachBatch({d.batch}) raises {type(error).__name__}: {error}")
        d.errors.append(error)
        if d.zombie:
            return
        if isinstance(error, FencedError | sm.PipelineOwnerError):
            raise SimViolation(f"the newest driver was refused: {error}")
        # The query failed. It restarts: the same writer again, or a new process.
        if self.rng.random() >= self.p.p_same_writer:
            d.alive = False
            for t in [t for t in self.tasks if t.job.driver is d]:
                self._end_task(t)
            self.trace(f"{d} exits; the query restarts in a new process")
            self.new_driver()

    # -- one step --

    def runnable(self) -> list[Driver | TaskAttempt]:
        out: list[Driver | TaskAttempt] = []
        for d in self.drivers:
            if not d.alive or d in self.held:
                continue
            if (
                d.fold is not None
                or d.actions
                or (d.job is not None and d.job.done)
                or (not d.in_call and d.job is None and self._wants_call(d))
            ):
                out.append(d)
        out.extend(t for t in self.tasks if t.job.driver not in self.held)
        return out

    def _wants_call(self, d: Driver) -> bool:
        if d.zombie:
            return d.zombie_calls > 0
        return self.spark_committed + 1 < self.batches

    def step(self) -> bool:
        """One move of one driver or task; False when nothing can move."""
        self.steps += 1
        if self.faults:
            if self.rng.random() < self.p.p_crash and self.live.alive:
                self.crash(self.live)
            elif self.rng.random() < self.p.p_zombie and self.live.in_call:
                self.start_zombie()
        who = self.runnable()
        if not who:
            return False
        pick = who[self.rng.randrange(len(who))]
        if isinstance(pick, TaskAttempt):
            self.task_step(pick)
        else:
            self.driver_step(pick)
        return True

    def driver_step(self, d: Driver) -> None:
        if d.fold is not None:
            self._fold_step(d)
        elif d.job is not None:
            job, d.job = d.job, None
            if job.failed:
                self.answer(d, sm.TasksFailed(job.failed))
            else:
                results = tuple(job.results[i] for i in range(self.p.partitions))
                self.answer(d, sm.TasksFinished(results))
        elif d.actions:
            self._act(d, d.actions.popleft())
        elif d.zombie:
            d.zombie_calls -= 1
            self.call(d, d.batch + 1)
        else:
            self.call(d, self.spark_committed + 1)

    def _act(self, d: Driver, action: sm.Action) -> None:
        fault = self.before_action(d, action) if self.before_action is not None else None
        if fault == "crash":
            self.crash(d)
            return
        if fault == "fail":
            self.fail_call(d, "a store did not answer")
            return
        if isinstance(action, sm.Log):
            self.trace(
                f"{d} log: {'txn=' + str(action.txn) + ' ' if action.txn else ''}{action.message}"
            )
            return
        if isinstance(action, sm.CrashPoint):
            if self.faults and self.rng.random() < self.p.p_crash_point:
                self.trace(f"{d} at crash point {action.name}")
                self.crash(d)
            return
        if isinstance(action, sm.Finish):
            self.end_call(d, None)
            return
        if isinstance(action, sm.Fail):
            self.end_call(d, action.error)
            return
        self.trace(f"{d} does {_show(action)}")
        try:
            self._request(d, action)
        except _IOFailure as exc:
            self.fail_call(d, str(exc))

    def fail_call(self, d: Driver, why: str) -> None:
        """A request raised: the writer tells the machine and lets the error end the call."""
        self.trace(f"{d} ... raises: {why}")
        d.machine.handle(sm.Interrupted())
        d.actions.clear()
        self.end_call(d, RetriableError(why))

    def _io(self, what: str, p: float) -> None:
        if self.faults and self.rng.random() < p:
            raise _IOFailure(f"{what} failed")

    def _request(self, d: Driver, action: sm.Request) -> None:
        if isinstance(action, sm.Fold):
            self._io("reading the control log", self.p.p_io_fail)
            d.fold = deque(env for _, env in self.log[self.group_offset :])
        elif isinstance(action, sm.Publish):
            self.answer(d, self._publish(d, action.payload))
        elif isinstance(action, sm.ListInDoubt):
            self._io(f"in_doubt of {action.sink}", self.p.p_io_fail)
            self.answer(d, sm.Listed(self.stores[action.sink].in_doubt()))
        elif isinstance(action, sm.ListStale):
            self._io(f"stale_parts of {action.sink}", self.p.p_io_fail)
            self.answer(d, sm.Listed(self.stores[action.sink].stale_parts(action.before_txn)))
        elif isinstance(action, sm.Resolve):
            self._io(f"{action.outcome.value} in {action.sink}", self.p.p_io_fail)
            store = self.stores[action.sink]
            if action.outcome is Outcome.COMMIT:
                store.commit(action.part)
            else:
                store.abort(action.part)
            self.answer(d, sm.Done())
        elif isinstance(action, sm.RunTasks):
            self._run_tasks(d, action)
        else:
            self._io("committing the checkpoint offset", self.p.p_io_fail)
            self.group_offset = action.offset
            self.answer(d, sm.Done())

    def _fold_step(self, d: Driver) -> None:
        assert d.fold is not None
        if not d.fold:
            d.fold = None
            self.answer(d, sm.CaughtUp())
            return
        env = d.fold.popleft()
        if self.faults and self.rng.random() < self.p.p_dup:
            d.fold.appendleft(env)  # read again: a duplicate
        for action in d.machine.handle(sm.Received(self.deliver(env))):
            if isinstance(action, sm.Fail):
                d.fold = None
            d.actions.append(action)

    def deliver(self, env: Envelope) -> Envelope:
        if not self.wire:
            return env
        from twophase.protocol import codec

        value, headers = codec.encode(env)
        return codec.decode(value, headers, pipeline=PIPELINE)

    def _publish(self, d: Driver, payload: Payload) -> sm.Event:
        if self.faults and self.rng.random() < self.p.p_publish_fail / 2:
            raise _IOFailure(f"writing {type(payload).__name__}")  # nothing landed
        if d.epoch < self.epoch:
            return sm.Fenced(f"epoch {d.epoch} < {self.epoch}")
        env = Envelope(str(len(self.log)), PIPELINE, d.machine.owner, self.steps, payload)
        offset = len(self.log)
        self.log.append((d.epoch, env))
        self.trace(f"LOG #{offset} epoch {d.epoch}: {_show_payload(payload)}")
        if self.faults and self.rng.random() < self.p.p_publish_fail / 2:
            raise _IOFailure(f"writing {type(payload).__name__} (it landed)")
        return sm.Published(env, offset, self.steps)

    # -- tasks --

    def _run_tasks(self, d: Driver, action: sm.RunTasks) -> None:
        job = TaskJob(d, action.batch_id, action.txn, action.tag)
        d.job = job
        for partition in range(self.p.partitions):
            if self.rows[action.batch_id][partition] == 0:
                job.results[partition] = sm.TaskResult(partition, None)
            else:
                self._new_attempt(job, partition)
                if self.faults and self.rng.random() < self.p.p_speculate:
                    self._new_attempt(job, partition)

    def _new_attempt(self, job: TaskJob, partition: int) -> None:
        d = job.driver
        participant = f"spark-{partition}.{job.tag}.{d.next_task_attempt}"
        d.next_task_attempt += 1
        steps = deque([("begin", s) for s in STORES] + [("prepare", s) for s in STORES])
        self.tasks.append(TaskAttempt(job, partition, participant, steps))

    def _end_task(self, t: TaskAttempt) -> None:
        if t in self.tasks:
            self.tasks.remove(t)
        for s in t.begun:
            self.stores[s].writer_gone(t.part)

    def task_step(self, t: TaskAttempt) -> None:
        job = t.job
        rows = self.rows[job.batch_id][t.partition]
        if self.faults and self.rng.random() < self.p.p_task_lost:
            self.trace(f"task {t.participant} (txn {job.txn}): executor lost")
            self._end_task(t)
            if not t.detached and not job.done:
                job.failures[t.partition] += 1
                if job.failures[t.partition] >= MAX_TASK_FAILURES:
                    job.failed = f"task {t.partition} failed {MAX_TASK_FAILURES} times"
                    self._job_over(job)
                elif not any(o.job is job and o.partition == t.partition for o in self.tasks):
                    self._new_attempt(job, t.partition)
            return
        what, store = t.steps.popleft()
        part = t.part
        if what == "begin":
            if not self.stores[store].begin(part, rows, t):
                self.trace(f"task {t.participant} (txn {job.txn}): lock wait in {store} timed out")
                self._abort_quietly(t)
                self._report(
                    t,
                    sm.TaskResult(t.partition, t.participant, 0, sink=store, error="lock timeout"),
                )
                return
            t.begun.append(store)
            if self.faults and self.rng.random() < self.p.p_reject:
                self.trace(f"task {t.participant} (txn {job.txn}): {store} refuses a row")
                self._abort_quietly(t)
                self._report(
                    t,
                    sm.TaskResult(
                        t.partition, t.participant, 0, sink=store, error="refused", rejected=1
                    ),
                )
                return
        elif not self.stores[store].prepare(part):
            self.trace(f"task {t.participant} (txn {job.txn}): prepare in {store} failed")
            self._abort_quietly(t)
            self._report(
                t, sm.TaskResult(t.partition, t.participant, 0, sink=store, error="part gone")
            )
            return
        if not t.steps:
            self.trace(f"task {t.participant} (txn {job.txn}) prepared {rows} rows")
            self._end_task(t)
            self._report(t, sm.TaskResult(t.partition, t.participant, rows, STORES))

    def _abort_quietly(self, t: TaskAttempt) -> None:
        for s in t.begun:
            if not (self.faults and self.rng.random() < self.p.p_io_fail):
                self.stores[s].abort(t.part)
        self._end_task(t)

    def _report(self, t: TaskAttempt, result: sm.TaskResult) -> None:
        job = t.job
        if t.detached or job.done or t.partition in job.results:
            return  # Spark kept another attempt's result
        job.results[t.partition] = result
        if job.done:
            self._job_over(job)

    def _job_over(self, job: TaskJob) -> None:
        """Spark stops waiting: tasks still running are cancelled, some only after a while."""
        for o in [o for o in self.tasks if o.job is job and not o.detached]:
            if self.faults and self.rng.random() < 0.5:
                o.detached = True
            else:
                self._end_task(o)

    # -- the run --

    def run_until(self, done: Callable[[], bool], max_steps: int = 20_000) -> None:
        for _ in range(max_steps):
            if done():
                return
            if not self.step():
                break
        if not done():
            raise SimViolation("the condition never came true")

    def quiesce(self, max_steps: int = 20_000) -> None:
        self.faults = False
        self.held.clear()
        for d in self.drivers:
            if d.zombie and d.alive:
                self.crash(d)
        for t in list(self.tasks):
            if t.detached:
                self._end_task(t)
        # One more batch, written with no zombie left: it resolves whatever they left behind.
        self._add_batches(1)
        self.batches += 1
        for _ in range(max_steps):
            if not self.step():
                break
        else:
            raise SimViolation(f"no quiescence within {max_steps} steps")

    def check(self) -> None:
        epochs = [e for e, _ in self.log]
        if epochs != sorted(epochs):
            raise SimViolation(f"a fenced writer's message landed: epochs {epochs}")
        if self.spark_committed != self.batches - 1:
            raise SimViolation(f"Spark stopped at batch {self.spark_committed} of {self.batches}")
        decisions = [env.payload for _, env in self.log if isinstance(env.payload, Decision)]
        twice = [t for t, n in Counter(d.txn for d in decisions).items() if n > 1]
        if twice:
            raise SimViolation(f"more than one decision for txns {twice}")
        view = LogView()
        for _, env in self.log:
            view.apply(env)
        if view.pending:
            raise SimViolation(f"committed, never COMPLETE: txns {sorted(view.pending)}")
        by_txn = {d.txn: d for d in decisions}
        if sorted(by_txn) != list(range(1, self.batches + 1)):
            raise SimViolation(f"decisions for txns {sorted(by_txn)}, batches {self.batches}")
        for d in decisions:
            if d.outcome is not Outcome.COMMIT or d.positions:
                raise SimViolation(f"txn {d.txn}: a Spark decision is a commit without positions")
            for part in d.parts:
                opened = self.log[part.generation][1].payload
                if not (isinstance(opened, Prepare) and opened.txn == d.txn):
                    raise SimViolation(f"txn {d.txn}: part {part.participant} has no PREPARE tag")
                if tag_of(PartId(PIPELINE, d.txn, part.participant)) != part.generation:
                    raise SimViolation(f"txn {d.txn}: part {part.participant} has another tag")
                if part.sinks != STORES:
                    raise SimViolation(f"txn {d.txn}: part {part.participant} not in every sink")
        for store in self.stores.values():
            for pid, sp in store.parts.items():
                if sp.state in (OPEN, PREPARED):
                    raise SimViolation(f"{store.name}: {pid.token} left {sp.state}")
                if sp.state == COMMITTED and not by_txn[pid.txn].includes(pid.participant):
                    raise SimViolation(f"{store.name}: {pid.token} committed, no decision names it")
            for batch_id, rows in enumerate(self.rows):
                txn = batch_id + 1
                got: Counter[int] = Counter()
                for pid, sp in store.parts.items():
                    if pid.txn == txn and sp.state == COMMITTED:
                        got[_partition(pid)] += 1
                        if sp.rows != rows[_partition(pid)]:
                            raise SimViolation(f"{store.name}: {pid.token} holds other rows")
                want = Counter(p for p, n in enumerate(rows) if n)
                if got != want:
                    raise SimViolation(
                        f"{store.name}: batch {batch_id} has partitions {dict(got)}, "
                        f"want each of {sorted(want)} once"
                    )

    def run(self) -> Result:
        error = seeds.play(self, SimViolation)
        return Result(
            self.seed, not error, error, self.steps, self.batches, len(self.drivers), self.lines
        )


def _partition(part: PartId) -> int:
    """The Spark partition in ``spark-<partition>.<tag>.<task>``."""
    return int(part.participant.split(".")[0].removeprefix("spark-"))


def _show_payload(payload: Payload) -> str:
    if isinstance(payload, Decision):
        parts = ", ".join(p.participant for p in payload.parts) or "no parts"
        return f"DECISION({payload.txn}, {payload.outcome.value}: {parts})"
    name = type(payload).__name__.upper()
    return f"{name}({getattr(payload, 'txn', getattr(payload, 'last_txn', ''))})"


def _show(action: sm.Action) -> str:
    if isinstance(action, sm.Publish):
        return f"publish {_show_payload(action.payload)}"
    if isinstance(action, sm.Resolve):
        return (
            f"{action.outcome.value} {action.part.txn}/{action.part.participant} in {action.sink}"
        )
    return repr(action)


def run(seed: int, verbose: bool = False, wire: bool = False) -> Result:
    return World(seed, verbose=verbose, wire=wire).run()


if __name__ == "__main__":
    sys.exit(seeds.main(__doc__, "tests.sim.spark_world", run))
