"""A deterministic simulator for the coordinator and participant state machines.

One seed drives everything -- through ``random.Random(seed)``, and a second stream for network
faults: which process moves next, message delays, record arrivals, rebalances, crashes,
failovers, partitions and sink failures. The very same machines that run in
production (:class:`twophase.coordinator.machine.CoordinatorMachine`,
:class:`twophase.participants.machine.ParticipantMachine`) are driven the way their runtimes drive them;
only Kafka, the consumer group and the sinks are replaced by small in-memory models.

A run has two phases. The *fault* phase takes random steps with faults switched on. The
*quiescence* phase switches faults off, restarts everything that is down and keeps going until
every source record is committed and nothing is left prepared (or a time bound is hit). Then the
guarantees of ``DESIGN.md`` are checked against the final state and the whole control log.

Reproduce one schedule exactly, with a trace of every event and action::

    .venv/bin/python -m tests.sim.world --seed 1234 --verbose   # from the repository root

What is modelled
----------------
* The control topic: one ordered, append-only log. Coordinator writes are atomic Kafka
  transactions checked against the leadership epoch (a deposed coordinator's write fails with
  ``fenced=True`` and lands nothing); they may also fail transiently (nothing lands). A commit
  DECISION sets the consumer group's committed offsets in the same transaction.
* Participant writes (votes, APPLIED, DRAINED) go through a per-process producer queue and land
  after a random delay, in order per writer, each on the topic it was addressed to (below),
  interleaved at random with other writers. When a participant crashes, a random prefix of its
  queue still lands (already sent) and the rest is lost.
* The reply topic (``PROTOCOL.md``, "The reply topic"): a second ordered, append-only log of one
  partition. In most seeds it exists from the start; in some never (the replies stay on the
  control topic); in some it appears mid-run, and each coordinator finds it at its own metadata
  read (when it wins leadership, and now and then). Only the leading coordinator reads it: from
  its CaughtUp on (or from finding the topic, mid-reign) until it steps down, starting at the
  ``replies_from`` of the latest CHECKPOINT it replayed that names the topic, else at its start;
  what it reads there is handed to the machine besides everything on the control topic. With its
  own delays: Kafka orders nothing across the two topics, so a reply may be read before or after
  the control messages written around it, an APPLIED long after. Reading it, the leader names it
  in ``reply_to`` of every message it writes, and every CHECKPOINT carries ``replies_from`` (the
  replies handed to the machine when the write started). A participant replies (VOTE, APPLIED)
  where the latest coordinator message it read, replayed or live, says -- "" being the control
  topic -- and folds its own APPLIED sent there in once it lands; DRAINED always goes to the
  control topic. In some seeds some participants are of an older version that replies on the
  control topic whatever ``reply_to`` says (a restart may upgrade one), and in some the second
  coordinator is, never reading the reply topic. Besides the guarantees, a run checks (8): every
  reply goes where the latest coordinator message its sender read says, and with every
  coordinator message naming the reply topic and no older participant, none is on the control
  topic.
* Readers read the log in order with random delays; a restarted participant replays from the
  latest CHECKPOINT; live readers sometimes re-read a few messages (duplicates).
* Coordinators: one active and one standby. The active one may crash (the standby takes over
  after a lease delay) or be deposed while still running (a zombie that keeps receiving events
  until its next write is fenced, and maybe a LeadershipLost later).
* Participants: a control thread and a data thread feeding one machine, each with its own queue
  of actions and each running one job at a time that yields at every sink call or listing, so
  the other thread interleaves wherever the real runtime releases the lock (between WillWrite
  and Written, between two sinks' commits, between an in-doubt listing and its InDoubt event).
  Crashes lose the machine, the queues and every open sink part; prepared parts stay.
* The consumer group: eager rebalances (Revoked, later Assigned with a new generation) delivered
  to each member at its own pace, so slow members keep working in the old generation for a while.
  Members join after their start-up replay (or, in some schedules, before it; then in half
  of them the assignment may reach the machine before the start-up in-doubt listing, which
  the runtime never lets happen but the machine must survive), leave a session
  timeout after a crash, get dropped while alive (and only notice later), and random
  rebalances happen too. Assigned offsets are the group's committed offsets.
* Sinks: two shared stores (like one PostgreSQL and one MongoDB) with the SDK's semantics; parts
  are open/prepared/committed/aborted; prepare may fail, commit and abort may fail retriably
  (the control thread retries later; the data thread gives an abort up and leaves the part to
  in-doubt resolution). Misuse of the SDK contract by the machines is a violation, including a
  control-thread abort of a part the data thread has open.

Network faults
--------------
Drawn per seed like the others (most seeds get some; a seed without them runs exactly the
schedule it ran before they existed: they draw from their own random stream). The clock runs
about 25 times faster than a real pipeline's (vote timeout 400 ms, real default 10 s).

* Delays: any message -- a control message to each of its readers, a reply to the coordinator
  reading them, a participant's VOTE or APPLIED on its way to the broker, a coordinator's write
  (the coordinator is blocked in it, as the runtime is in its Kafka transaction), a source
  record on its way to the consumers -- may arrive up to ``Params.delay_ms`` late (0-900 ms:
  some outlast the vote timeout). Kafka's guarantee is kept and nothing more: order within one
  partition (the control topic is one, the reply topic one; each source partition is one), none
  across partitions or topics, nor between readers. So a DECISION can be read before a record
  produced ahead of it, a VOTE can reach the coordinator after it decided abort on its deadline,
  two participants see the log at different times.
* Partitions (``Params.p_cut``, 30-1,500 ms each; they heal by themselves, also after the fault
  phase, and quiescence waits for that):
  - a participant cut off from Kafka but not its stores: it reads no control message and no
    record, sees no rebalance, and its producer holds its VOTEs and APPLIEDs; its sink calls
    still work (decisions it has read are applied, prepares finish). The group drops it after a
    session timeout and rebalances; it notices once it reaches Kafka again. A message its
    producer could not deliver for ``PUBLISH_GIVE_UP_MS`` ends the process (the runtime's send
    gives up and the control thread fails); it restarts, still cut off until the partition
    heals.
  - a participant cut off from one or both stores but not Kafka: the data thread's calls
    (begin, write, prepare, abort) block and are given up after ``SINK_GIVE_UP_MS`` -- a given-up
    begin or write leaves the part poisoned (nothing read until the rewind, its prepare fails
    without touching the sinks: the runtime's ``_failed_txn``), a given-up prepare votes abort,
    a given-up abort drops the connection (the store rolls an open part back; a prepared one is
    left in doubt). Commits and aborts of decided parts fail retriably and are retried until the
    store answers; a sweep that cannot list is skipped; start-up recovery waits for the stores.
  - both at once.
  - a coordinator cut off from Kafka (the leader, mostly): it reads nothing, its metadata does
    not refresh, its write blocks until the partition heals, or is given up after
    ``PUBLISH_GIVE_UP_MS`` (the transaction is aborted: nothing lands). After its session timeout
    the standby, if it can, wins the control partition -- a new epoch, which fences whatever the
    old leader's blocked write still tries -- and the old leader hears of it once it reaches
    Kafka again, or only from being fenced.
  A coordinator killed while blocked in a write may still have its write land (the commit had
  reached the broker), unless a newer epoch has fenced it by then.

What the runtime must do for these results to hold (the simulator's data thread does exactly
this): call ``WillWrite`` only when no Seek or AbortPart handed over by the control thread is
waiting (check under the machine lock; a queued PreparePart may wait one batch); drop fetched
records on Seek; poll before WillWrite; subscribe to the source group with the log start as the
offset of partitions the group has never committed, on both the participant and the coordinator
side (``SourcePartitions.group_offsets``); call ``WillWrite`` only while the machine is
``ready`` (caught up, the start-up in-doubt listing folded in, assigned). The machine itself
votes a PREPARE still open at start-up only on an assignment after the listing (else it
would vote an empty part though an earlier incarnation's part of that transaction is
prepared, and a commit of the empty part would make a later sweep commit the other one,
whose records no position covers: the simulator's seed 9841 found it when the runtime's
order was the only guard; ``test_scenarios`` puts the assignment first at the worst point).

Source topics created while the pipeline runs (``topic_pattern``): some seeds add one or two
one-partition topics that the coordinator's metadata and the group (a rebalance) each find at
their own random moment, so votes name topics the coordinator does not show yet and the
coordinator shows topics no voter reads yet; votes carry their ``topics`` (the coverage rule).

What is not modelled: dead-lettering and poison records, partitions added to an existing topic,
topics deleted (the reply topic included), control- and reply-topic retention/compaction (the
whole logs are kept), decode errors, messages other than replies on the reply topic
(``misplaced``), a metadata read that fails (a coordinator taking over always sees the reply
topic if it exists), a reply topic of several partitions,
real time, clock skew between processes, participants with different sink sets, and Kafka's own
failure modes beyond the ones above (e.g. a consumer group that loses committed offsets, a
commit_transaction with an unknown outcome, a broker failover). Of the network: a sink call that
took effect but whose answer was lost (every call either happens or fails), partial partitions
(an actor that reaches some brokers only), a participant's producer retrying a message it had
already delivered (duplicates come from re-reads instead), and the participant's control thread
blocking in a send (its producer queue holds messages and the thread goes on).
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections import Counter, deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from twophase.coordinator import machine as cm
from twophase.participants import machine as pm
from twophase.protocol.logview import LogView
from twophase.protocol.messages import (
    COORDINATOR_MESSAGES,
    Applied,
    Checkpoint,
    Complete,
    Decision,
    Envelope,
    Outcome,
    Payload,
    Prepare,
    Vote,
    VoteValue,
)

from . import seeds

__all__ = ["Params", "Result", "SimViolation", "World", "run"]

PIPELINE = "sim"
TOPIC = "src"
REPLY_TOPIC = f"twophase.control.{PIPELINE}.replies"
STORES = ("pg", "mongo")
TP = tuple[str, int]

OPEN, PREPARED, COMMITTED, ABORTED = "open", "prepared", "committed", "aborted"

TICK_MS = 50


class SimViolation(AssertionError):
    """A guarantee, or the sink contract, was broken."""


class RetriableError(Exception):
    """A sink's transient failure: the runtime retries later."""


class PrepareError(Exception):
    """A sink could not prepare."""


# -- the sink stores ----------------------------------------------------------------------------


@dataclass(slots=True)
class StorePart:
    state: str
    owner: tuple[str, int]  # (participant, incarnation) whose data thread opened it
    records: list[tuple[int, int]] = field(default_factory=list)  # (partition, offset)
    positions: dict[TP, int] = field(default_factory=dict)


class Store:
    """One shared store (a database), holding every participant's parts of the pipeline."""

    def __init__(self, world: World, name: str) -> None:
        self.world = world
        self.name = name
        self.parts: dict[tuple[int, str], StorePart] = {}
        #: Scripted faults for hand-written scenarios: fail this many commits/aborts.
        self.fail_next = 0
        self.open_by: dict[tuple[str, int], tuple[int, str]] = {}

    def _fail(self, what: str) -> None:
        raise SimViolation(f"sink {self.name}: {what}")

    def begin(self, txn: int, participant: str, owner: tuple[str, int]) -> None:
        key = (txn, participant)
        old = self.parts.get(key)
        if old is not None and old.state in (OPEN, PREPARED, COMMITTED):
            self._fail(f"begin of part {key} which is {old.state}")
        if owner in self.open_by:
            self._fail(f"begin of {key} while {self.open_by[owner]} is still open (one at a time)")
        self.parts[key] = StorePart(OPEN, owner)
        self.open_by[owner] = key

    def write(self, txn: int, participant: str, owner: tuple[str, int], recs: list[Any]) -> None:
        part = self.parts.get((txn, participant))
        if part is None or part.state != OPEN or part.owner != owner:
            self._fail(f"write into part {(txn, participant)} that is not open here")
        assert part is not None
        part.records.extend(recs)

    def prepare(
        self, txn: int, participant: str, owner: tuple[str, int], positions: dict[TP, int]
    ) -> None:
        key = (txn, participant)
        part = self.parts.get(key)
        if part is None or part.state != OPEN or part.owner != owner:
            self._fail(
                f"prepare of part {key} that is not open here ({part.state if part else 'unknown'})"
            )
        assert part is not None
        if self.world.fault(self.world.p.p_prepare_fail):
            raise PrepareError(f"{self.name} refused to prepare {key}")
        part.state = PREPARED
        part.positions = dict(positions)
        self.open_by.pop(owner, None)

    def commit(self, txn: int, participant: str) -> None:
        key = (txn, participant)
        part = self.parts.get(key)
        if part is None:
            self._fail(f"commit of unknown part {key}")
        assert part is not None
        if part.state == COMMITTED:
            return
        if part.state != PREPARED:
            self._fail(f"commit of part {key} which is {part.state}")
        if self.fail_next or self.world.fault(self.world.p.p_commit_fail):
            self.fail_next = max(0, self.fail_next - 1)
            raise RetriableError(f"{self.name} commit of {key} timed out")
        part.state = COMMITTED

    def abort(self, txn: int, participant: str, caller: tuple[str, int], data: bool) -> None:
        key = (txn, participant)
        part = self.parts.get(key)
        if part is None or part.state == ABORTED:
            return
        if part.state == COMMITTED:
            self._fail(f"abort of committed part {key}")
        if part.state == OPEN:
            if not data or part.owner != caller:
                # A real store cannot roll back another connection's open transaction; a file
                # sink would delete a staging area under the writer's feet. Either way a bug.
                self._fail(f"abort of part {key} that another thread/process is writing")
            self.open_by.pop(part.owner, None)
        elif self.world.fault(self.world.p.p_commit_fail):
            raise RetriableError(f"{self.name} abort of {key} timed out")
        part.state = ABORTED

    def abandon(self, owner: tuple[str, int]) -> None:
        """The owner crashed: its open part is rolled back by the store."""
        key = self.open_by.pop(owner, None)
        if key is not None:
            self.parts[key].state = ABORTED

    def in_doubt(self) -> list[tuple[int, str]]:
        return [k for k, p in self.parts.items() if p.state == PREPARED]


# -- parameters -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Params:
    """Everything a schedule depends on, drawn from the seed (so the seed alone reproduces it)."""

    participants: int
    partitions: int
    fault_steps: int
    records: int
    checkpoint_every: int
    p_prepare_fail: float
    p_commit_fail: float
    p_publish_fail: float
    p_crash_participant: float
    p_crash_coordinator: float
    p_depose: float
    p_rebalance: float
    p_kick: float
    p_duplicate: float
    quiesce_ms: int = 60_000
    max_steps: int = 60_000
    #: Topics (one partition each) created while the pipeline runs, as a topic_pattern finds
    #: them: the coordinator's metadata and the group see each at its own moment.
    new_topics: int = 0
    #: Network faults (see "Network faults" above). The longest delay of one message (0: no
    #: delays), and the chance that a message is delayed at all.
    delay_ms: int = 0
    p_delay: float = 0.0
    #: Partitions between an actor and Kafka or a store.
    p_cut: float = 0.0
    #: Participants read to the end say so (DRAINED), and the coordinator starts cycles early.
    drained: bool = False
    #: When the reply topic exists (see "The reply topic" above), in ms from the start: 0 from
    #: the start, -1 never (the replies stay on the control topic).
    reply_topic_at: int = 0
    #: Participants (P0, P1, ...) of an older version, which ignore ``reply_to``.
    old_participants: int = 0
    #: The second coordinator (C1) is of an older version: it never reads the reply topic.
    old_coordinator: bool = False

    @classmethod
    def calm(cls, participants: int = 3, partitions: int = 4, records: int = 30) -> Params:
        """No random faults: hand-written scenarios inject their own."""
        return cls(participants, partitions, 0, records, 3, *([0.0] * 9))

    @classmethod
    def draw(cls, rng: random.Random) -> Params:
        def maybe(p: float) -> float:
            return p if rng.random() < 0.6 else 0.0

        # Drawn apart, so that the main stream (every other seed's schedule) stays as it was.
        extra = random.Random(rng.random())
        participants = rng.randint(2, 4)
        return cls(
            new_topics=extra.choice((0, 0, 1, 2)),
            # Some delays outlast the vote timeout (400 ms), some are barely there.
            delay_ms=extra.choice((0, 0, 40, 150, 500, 900)),
            p_delay=extra.choice((0.05, 0.2, 0.5)),
            p_cut=extra.choice((0.0, 0.0, 0.003, 0.008)),
            drained=extra.random() < 0.5,
            # Mostly there from the start (``twophase topics create`` makes it); else never, or
            # made while the pipeline runs.
            reply_topic_at=extra.choice((0, 0, 0, 0, 0, 0, -1, -1, *[extra.randint(20, 1500)] * 2)),
            old_participants=extra.randint(1, participants) if extra.random() < 0.2 else 0,
            old_coordinator=extra.random() < 0.1,
            participants=participants,
            partitions=rng.randint(2, 6),
            fault_steps=rng.randint(150, 500),
            records=rng.randint(10, 40),
            checkpoint_every=rng.choice((1, 2, 3, 5, 20)),
            p_prepare_fail=maybe(0.05),
            p_commit_fail=maybe(0.1),
            p_publish_fail=maybe(0.03),
            p_crash_participant=maybe(0.006),
            p_crash_coordinator=maybe(0.002),
            p_depose=maybe(0.002),
            p_rebalance=maybe(0.012),
            p_kick=maybe(0.006),
            p_duplicate=maybe(0.01),
        )


COORD_SETTINGS = dict(
    commit_interval_ms=60,
    vote_timeout_ms=400,
    max_failed_cycles=4,
    publish_retry_ms=50,
    early_min_records=1,  # DRAINED hints start cycles early whenever they cover every partition
)
SWEEP_MS = 300
SESSION_TIMEOUT_MS = (100, 300)
LEASE_MS = (50, 200)
RESTART_MS = (20, 300)
#: How long a partition lasts. The simulator's clock runs about 25 times faster than the real
#: pipeline's (its vote timeout is 400 ms, the default 10 s), so this is the chaos suite's 5-60 s
#: partition, with shorter ones besides: some end within a session timeout, some outlast it, the
#: vote timeout and both give-ups below.
CUT_MS = (30, 1500)
#: A sink call the data thread makes (begin, write, prepare, abort) is retried for this long,
#: then given up (``participant.sink_retry_s``, 60 s, would be 2,400 ms here: shorter, so that
#: the give-up paths run in the partitions drawn). Applying a decision is retried for ever.
SINK_GIVE_UP_MS = 600
#: A control message the producer cannot deliver (librdkafka retries it until the flush times
#: out, the runtime retries the send for its budget): the participant process exits; the
#: coordinator's Kafka transaction is aborted (nothing lands) and reported as failed.
PUBLISH_GIVE_UP_MS = 1000


# -- processes --------------------------------------------------------------------------------


class Lag:
    """How much of the control log (or, ``replies``, of the reply topic) one reader's consumer
    has fetched: each entry reaches it at its own time, never before the one ahead of it (one
    partition: order is kept)."""

    __slots__ = ("due", "last", "replies", "upto")

    def __init__(self, start: int = 0, replies: bool = False) -> None:
        self.upto = start  # entries below this one have arrived (or are not read)
        self.due: int | None = None  # when entry ``upto`` arrives
        self.last = 0
        self.replies = replies

    def visible(self, w: World) -> int:
        log, times = (w.replies, w.reply_times) if self.replies else (w.log, w.log_times)
        if not w.p.delay_ms:
            return len(log)
        while self.upto < len(log):
            if self.due is None:
                # The reply topic's delays have a stream of their own: a schedule without the
                # topic draws what it drew before it existed.
                delay = w.delay(w.reply_rng if self.replies else w.net)
                if delay:
                    w.seen["reply delayed" if self.replies else "control message delayed"] += 1
                self.due = max(self.last, times[self.upto] + delay)
            if w.now < self.due:
                break
            self.last, self.due = self.due, None
            self.upto += 1
        return self.upto


@dataclass(slots=True)
class Outgoing:
    """A message in a participant's producer: queued at ``queued``, lands at ``lands`` (after
    the ones ahead of it) on ``topic`` -- the reply topic, or "" for the control topic."""

    queued: int
    lands: int
    msg: Payload
    topic: str = ""


class Participant:
    """One participant process: a machine, a control thread and a data thread.

    Each thread runs one *job* at a time: a generator that yields wherever the real runtime
    does I/O (one sink call, one listing), so the other thread's work interleaves there.
    """

    def __init__(self, world: World, name: str, incarnation: int) -> None:
        self.world = world
        self.name = name
        self.incarnation = incarnation
        self.owner = (name, incarnation)
        self.member_id = f"{name}-{incarnation}"
        self.machine = pm.ParticipantMachine(
            pm.ParticipantSettings(name, STORES, sweep_interval_ms=SWEEP_MS)
        )
        self.alive = True
        #: An older version: replies on the control topic whatever ``reply_to`` says.
        self.old = name in world.old
        #: Where VOTE and APPLIED go: the ``reply_to`` of the latest coordinator message fed
        #: ("": the control topic); and, for the check, the log index of that message.
        self.reply_to = ""
        self.told_at = -1
        self.cursor = world.latest_checkpoint()
        self.replay_end = len(world.log)
        self.lag = Lag(self.cursor)
        self.caught_up = False
        self.ctl_q: deque[pm.Action] = deque()
        self.ctl_job: Iterator[None] | None = None
        self.retry: list[tuple[int, pm.Action]] = []
        self.data_q: deque[pm.Action] = deque()
        self.data_job: Iterator[None] | None = None
        self.open_txn: int | None = None
        self.fetch: dict[TP, int] = {}
        #: The producer's queue, landing in order (whatever topic each message goes to).
        self.outbox: deque[Outgoing] = deque()
        #: A sink call of the data thread was given up: nothing is read until the next Seek,
        #: and a prepare of ``failed_txn`` fails without touching the sinks (the runtime's
        #: ``_poisoned`` and ``_failed_txn``).
        self.poisoned = False
        self.failed_txn: int | None = None
        self.rebalance = 0  # 1: Revoked due, 2: Assigned due
        self.joined = False
        #: The start-up recovery (replay, then the in-doubt listing) is done: only then does the
        #: runtime start its data thread, the one that polls -- so however early the consumer
        #: joined the group, no assignment reaches the machine before the listing.
        self.recovered = False
        self.next_tick = world.now
        # Hand-written scenarios freeze a thread with these.
        self.hold_control = False
        self.hold_data = False
        if world.join_early:
            world.join_when_reachable(self)

    # -- feeding the machine --

    def feed(self, event: pm.Event, data: bool) -> list[pm.Action]:
        """Hand ``event`` to the machine; queue the other thread's actions and return this
        thread's DATA actions, which the caller runs at once (the runtime does the same)."""
        w = self.world
        if (
            isinstance(event, pm.Received)
            and isinstance(event.env.payload, COORDINATOR_MESSAGES)
            and not self.old
        ):
            self.reply_to = event.env.reply_to  # the latest one read decides, "" included
        actions = self.machine.handle(event)
        if w.verbose:
            w.trace(f"{self.member_id}.{'data' if data else 'ctl '} <- {_show(event)}")
            for a in actions:
                w.trace(f"{' ' * len(self.member_id)}      -> {_show(a)}")
        inline: list[pm.Action] = []
        for a in actions:
            if isinstance(a, pm.Skipped):
                # Every message here was written by the real machines: refusing one as out of
                # sequence would be refusing a legitimate log.
                raise SimViolation(f"{self.member_id}: refused a legitimate message: {a!r}")
            if isinstance(a, pm.Log):
                continue
            if a.thread is pm.Thread.DATA:
                (inline if data else self.data_q).append(a)
            else:
                self.ctl_q.append(a)
        return inline

    def feed_data(self, event: pm.Event) -> Iterator[None]:
        for a in self.feed(event, data=True):
            yield from self.data_action(a)

    # -- scheduling --

    def add_moves(self, out: list[tuple[int, Callable[[], None]]]) -> None:
        if not self.hold_control:
            self.add_control_moves(out)
        if not self.hold_data and (self.recovered or (self.world.assign_early and self.caught_up)):
            self.add_data_moves(out)
        if (
            self.outbox
            and self.outbox[0].lands <= self.world.now
            and self.name not in self.world.kafka_cuts
        ):
            out.append((3, self.flush))

    def add_control_moves(self, out: list[tuple[int, Callable[[], None]]]) -> None:
        w = self.world
        if self.ctl_job is not None:
            out.append((5, self.step_control))
            return
        if self.ctl_q:
            out.append((6, self.run_next_control))
        if self.retry and self.retry[0][0] <= w.now:
            out.append((2, self.run_retry))
        if not self.caught_up and self.cursor >= self.replay_end:
            out.append((5, self.catch_up))
        elif (
            self.cursor < len(w.log)
            and self.name not in w.kafka_cuts
            and (not w.p.delay_ms or self.cursor < self.lag.visible(w))
        ):
            out.append((4, self.read))
        if w.now >= self.next_tick:
            out.append((2, self.tick))

    def add_data_moves(self, out: list[tuple[int, Callable[[], None]]]) -> None:
        """One job at a time; queued actions before rebalances before new records."""
        w = self.world
        if self.data_job is not None:
            out.append((5, self.step_data))
            return
        if self.data_q:
            out.append((6, self.run_next_data))
            # A runtime checks its queue, then polls: a PREPARE handed over meanwhile waits
            # until after the batch. A Seek or an abort never may (the batch is stale then).
            if not all(isinstance(a, pm.PreparePart) for a in self.data_q):
                return
        if self.name in w.kafka_cuts:
            return  # poll() returns nothing: no records, no rebalance
        if self.rebalance:
            out.append((w.rebalance_weight, self.poll_rebalance))
        elif self.machine.ready and not self.poisoned:
            avail, index = w.avail, w.index
            for tp, off in self.fetch.items():
                if off < avail[index[tp]]:
                    out.append((4, self.start_batch))
                    break
            else:
                if w.p.drained:
                    out.append((1, self.start_quiet))  # read to the end: the input went quiet

    def step_control(self) -> None:
        assert self.ctl_job is not None
        if next(self.ctl_job, StopIteration) is StopIteration:
            self.ctl_job = None

    def step_data(self) -> None:
        assert self.data_job is not None
        if next(self.data_job, StopIteration) is StopIteration:
            self.data_job = None

    def start_control(self, job: Iterator[None]) -> None:
        self.ctl_job = job
        self.step_control()

    def start_data(self, job: Iterator[None]) -> None:
        self.data_job = job
        self.step_data()

    # -- the control thread --

    def run_next_control(self) -> None:
        self.start_control(self.control_action(self.ctl_q.popleft()))

    def run_retry(self) -> None:
        _, a = self.retry.pop(0)
        self.start_control(self.control_action(a))

    def catch_up(self) -> None:
        self.caught_up = True
        self.feed(pm.CaughtUp(), data=False)
        self.start_control(self.list_in_doubt(sweep=False))

    def list_in_doubt(self, sweep: bool) -> Iterator[None]:
        w = self.world
        cut = [s for s in STORES if not w.reaches_store(self.name, s)]
        if cut and sweep:
            if w.verbose:
                w.trace(
                    f"{self.member_id}.ctl  !! sweep cannot list {','.join(cut)}; next one tries"
                )
            return
        for s in cut:  # start-up recovery waits for every store, however long it takes
            while not w.reaches_store(self.name, s):
                yield
        parts = w.list_in_doubt()
        # What describing the group would say: members until their session expires, crashed
        # or not; nothing (None) when the group cannot be described.
        live = frozenset(p.name for p in w.members.values()) if w.reaches_kafka(self.name) else None
        yield  # the listing takes a while; the data thread goes on meanwhile
        self.feed(pm.InDoubt(parts, sweep=sweep, live=live), data=False)
        if not sweep:
            self.recovered = True
        if not sweep and not self.joined:
            w.join_when_reachable(self)  # the runtime subscribes once recovery is done

    def read(self) -> None:
        env = self.world.log[self.cursor]
        if isinstance(env.payload, COORDINATOR_MESSAGES):
            self.told_at = self.cursor
        self.cursor += 1
        self.feed(
            pm.Received(self.world.deliver(env), replay=self.cursor <= self.replay_end), False
        )

    def tick(self) -> None:
        self.next_tick = self.world.now + TICK_MS
        self.feed(pm.Tick(self.world.now), data=False)

    def control_action(self, a: pm.Action) -> Iterator[None]:
        w = self.world
        if isinstance(a, pm.CommitPart | pm.AbortPart):
            for s in a.sinks:
                try:
                    if not w.reaches_store(self.name, s):
                        raise RetriableError(f"{s} unreachable")
                    if isinstance(a, pm.CommitPart):
                        w.stores[s].commit(a.txn, a.participant)
                    else:
                        w.stores[s].abort(a.txn, a.participant, self.owner, data=False)
                except RetriableError as exc:
                    if w.verbose:
                        w.trace(f"{self.member_id}.ctl  !! {exc}; retry later")
                    self.retry.append((w.now + w.rng.randint(20, 200), a))
                    self.retry.sort(key=lambda r: r[0])
                    return
                yield
            outcome = Outcome.COMMIT if isinstance(a, pm.CommitPart) else Outcome.ABORT
            self.feed(pm.PartApplied(a.txn, a.participant, outcome), data=False)
        elif isinstance(a, pm.SendVote | pm.SendApplied):
            msg = a.vote if isinstance(a, pm.SendVote) else a.applied
            delay = w.delay()
            if delay:
                w.seen["participant's message delayed"] += 1
            lands = max(self.outbox[-1].lands if self.outbox else 0, w.now + delay)
            told = w.log[self.told_at].reply_to if self.told_at >= 0 else ""
            if not self.old and self.reply_to != told:
                raise SimViolation(
                    f"(8) {self.member_id} sends {_show(msg)} to {self.reply_to or 'the control'}"
                    f" topic, but the latest coordinator message it read says {told or 'none'}"
                )
            self.outbox.append(Outgoing(w.now, lands, msg, self.reply_to))
        elif isinstance(a, pm.Sweep):
            yield from self.list_in_doubt(sweep=True)
        else:
            raise SimViolation(f"{self.member_id}: control thread got {a!r}")

    # -- the data thread --

    def run_next_data(self) -> None:
        self.start_data(self.data_action(self.data_q.popleft()))

    def poll_rebalance(self) -> None:
        self.start_data(self.rebalance_job())

    def rebalance_job(self) -> Iterator[None]:
        w = self.world
        self.fetch = {}
        if self.rebalance == 1:
            self.rebalance = 2
            yield from self.feed_data(pm.Revoked())
            return
        self.rebalance = 0
        mine = sorted(w.assignment.get(self.member_id, ()))
        offsets = {tp: w.group_offsets.get(tp, 0) for tp in mine}
        yield from self.feed_data(
            pm.Assigned(w.generation, self.member_id, offsets, w.group_topics())
        )

    def start_batch(self) -> None:
        self.start_data(self.batch_job())

    def start_quiet(self) -> None:
        self.start_data(self.feed_data(pm.Quiet(dict(self.fetch))))

    def batch_job(self) -> Iterator[None]:
        """poll, WillWrite, write into every sink, Written: the runtime's write path."""
        w = self.world
        batch: dict[TP, tuple[int, int, int]] = {}
        recs: list[tuple[int, int]] = []
        for tp, off in sorted(self.fetch.items()):
            i = w.index[tp]
            avail = w.avail[i] - off
            if avail <= 0 or (batch and w.rng.random() < 0.3):
                continue
            n = w.rng.randint(1, min(avail, 3))
            recs += [(i, o) for o in range(off, off + n)]
            batch[tp] = (off + n - 1, n, 0)
            self.fetch[tp] = off + n
        yield from self.feed_data(pm.WillWrite())
        if self.poisoned:
            return  # beginning the part was given up
        txn = self.open_txn
        if txn is None:
            raise SimViolation(f"{self.member_id}: WillWrite left no part open to write into")
        for s in STORES:
            yield
            if not (yield from self.reach(s, f"write of {txn}")):
                # The part is lost: read nothing until the rewind its failed prepare brings.
                self.failed_txn, self.poisoned = txn, True
                return
            w.stores[s].write(txn, self.name, self.owner, recs)
        yield from self.feed_data(pm.Written(txn, batch))

    def reach(self, store: str, what: str) -> Generator[None, None, bool]:
        """Wait while ``store`` is cut off (the runtime retries the call); True once it answers,
        False when the call is given up (SINK_GIVE_UP_MS)."""
        w = self.world
        since = w.now
        while not w.reaches_store(self.name, store):
            if w.now - since >= SINK_GIVE_UP_MS:
                w.seen[f"{what.split()[0]} given up"] += 1
                if w.verbose:
                    w.trace(f"{self.member_id}.data !! {what} in {store} given up: unreachable")
                return False
            yield
        return True

    def data_action(self, a: pm.Action) -> Iterator[None]:
        w = self.world
        if isinstance(a, pm.BeginPart):
            self.open_txn = a.txn
            for s in STORES:
                if not (yield from self.reach(s, f"begin of {a.txn}")):
                    self.failed_txn, self.poisoned = a.txn, True
                    return
                w.stores[s].begin(a.txn, self.name, self.owner)
                yield
        elif isinstance(a, pm.PreparePart) and not a.ready:
            yield from self.feed_data(pm.Cut(a.txn))
        elif isinstance(a, pm.PreparePart) and a.txn == self.failed_txn:
            # A write of this part was given up: the part is not whole, so it is not prepared.
            yield from self.feed_data(pm.PrepareFailed(a.txn, "a write of this part failed"))
        elif isinstance(a, pm.PreparePart):
            if a.sinks and self.open_txn != a.txn:
                raise SimViolation(
                    f"{self.member_id}: prepare of {a.txn} but the open part is {self.open_txn}"
                )
            if not a.sinks and self.open_txn is not None:
                raise SimViolation(
                    f"{self.member_id}: empty prepare of {a.txn} while part {self.open_txn} "
                    "is open in the sinks"
                )
            self.open_txn = None
            for s in a.sinks:
                try:
                    if not (yield from self.reach(s, f"prepare of {a.txn}")):
                        raise PrepareError(f"{s} unreachable")
                    w.stores[s].prepare(a.txn, self.name, self.owner, dict(a.positions))
                except PrepareError as exc:
                    yield from self.feed_data(pm.PrepareFailed(a.txn, str(exc)))
                    return
                yield
            yield from self.feed_data(pm.PrepareDone(a.txn))
        elif isinstance(a, pm.AbortPart):
            for s in a.sinks:
                if not (yield from self.reach(s, f"abort of {a.txn}")):
                    # The runtime drops the connection: the store rolls an open part back; a
                    # prepared one is left to in-doubt resolution, as below.
                    w.stores[s].abandon(self.owner)
                    continue
                # Only a prepared part can fail to abort: this runtime gives up and leaves it
                # to the machine's in-doubt resolution (the sweep), the harder path to get right.
                with contextlib.suppress(RetriableError):
                    w.stores[s].abort(a.txn, self.name, self.owner, data=True)
                yield
            if a.txn == self.open_txn:
                self.open_txn = None
        elif isinstance(a, pm.Seek):
            self.fetch = dict(a.offsets)
            self.poisoned, self.failed_txn = False, None
        elif isinstance(a, pm.SendDrained):
            w.seen["DRAINED sent"] += 1
            # Always on the control topic: peers read it.
            lands = max(self.outbox[-1].lands if self.outbox else 0, w.now)
            self.outbox.append(Outgoing(w.now, lands, a.drained))
        else:
            raise SimViolation(f"{self.member_id}: data thread got {a!r}")

    # -- the producer --

    def flush(self) -> None:
        out = self.outbox.popleft()
        env = self.world.land(self.member_id, out)
        if out.topic and isinstance(out.msg, Applied):
            # Nobody reads it back to us: fold it in on delivery, as reading it would (the
            # runtime's send returns the envelope with ``reply_to`` naming the topic).
            self.world.seen["own APPLIED folded in on delivery"] += 1
            self.feed(pm.Received(replace(env, reply_to=out.topic)), data=False)


class Coordinator:
    def __init__(self, world: World, name: str, incarnation: int) -> None:
        self.world = world
        self.name = name
        self.incarnation = incarnation
        self.label = f"{name}-{incarnation}"
        self.machine = cm.CoordinatorMachine(
            cm.CoordinatorSettings(
                checkpoint_every=world.p.checkpoint_every,
                # With DRAINED hints, a long interval: most cycles then start early.
                **{**COORD_SETTINGS, "commit_interval_ms": 300}
                if world.p.drained
                else COORD_SETTINGS,
            )
        )
        self.alive = True
        #: An older version: never reads the reply topic, so never names it.
        self.old = world.p.old_coordinator and name == "C1"
        self.epoch = -1
        self.reading = False
        self.cursor = 0
        self.replay_end = 0
        self.next_tick = world.now
        self.lost_at: int | None = None  # when a deposed leader learns it lost its lease
        self.failed_run = 0  # consecutive aborts published since leadership
        self.alarmed = False
        self.fenced_writes = 0
        self.hold = False  # hand-written scenarios freeze the coordinator with this
        self.lag = Lag()
        #: Whether the replay since leadership was won has reached its end (CaughtUp).
        self.recovered = False
        #: The reply topic as the last metadata read showed it.
        self.reply_found = False
        #: Reading the reply topic (leading, recovered, the topic found): the next reply to hand
        #: to the machine -- every reply below it is reflected in what it writes -- and where the
        #: reading started; None: not reading (replies come on the control topic only).
        self.replies_next: int | None = None
        self.replies_start = 0
        self.reply_lag = Lag(replies=True)
        #: ``replies_from`` of the latest CHECKPOINT replayed that names the reply topic; -1: none.
        self.replies_checkpointed = -1
        self.replies_at_acquire = 0  # how long the reply topic was when we last won
        #: Events not handled yet and writes not started yet: the runtime handles one event's
        #: actions in order, each write blocking until Kafka answers.
        self.events: deque[cm.Event] = deque()
        self.writes: deque[Payload] = deque()
        #: The write the process is blocked in: (message, started, lands at, epoch, reply_to).
        self.inflight: tuple[Payload, int, int, int, str] | None = None
        self.feed_partitions()

    def can_lead(self) -> bool:
        """Whether this process can win the control partition: alive, reaching Kafka, and not
        blocked in a write (the group's callbacks run in poll(), between writes)."""
        return self.alive and self.inflight is None and self.world.reaches_kafka(self.name)

    def feed(self, event: cm.Event) -> None:
        self.events.append(event)
        self.pump()

    def pump(self) -> None:
        w = self.world
        while self.alive and self.inflight is None:
            if self.writes:
                self.start_write(self.writes.popleft())
                continue
            if not self.events:
                return
            ev = self.events.popleft()
            early = self.machine.early_cycles
            actions = self.machine.handle(ev)
            if self.machine.early_cycles != early:
                w.seen["cycle started early"] += 1
            if w.verbose:
                w.trace(f"{self.label} <- {_show(ev)}")
                for a in actions:
                    w.trace(f"{' ' * len(self.label)}    -> {_show(a)}")
            for a in actions:
                if isinstance(a, cm.Publish):
                    self.writes.append(a.payload)
                elif isinstance(a, cm.Alarm):
                    self.alarmed = a.active
                    w.alarms.append((self.label, a))
                elif isinstance(a, cm.StepDown):
                    self.reading = False
                    self.close_replies()
                elif isinstance(a, cm.Skipped):
                    raise SimViolation(f"{self.label}: refused a legitimate message: {a!r}")
            if (
                isinstance(ev, cm.Published)
                and isinstance(ev.payload, Decision)
                and self.failed_run >= COORD_SETTINGS["max_failed_cycles"]
                and not self.alarmed
            ):
                w.missing_alarm = f"{self.label}: {self.failed_run} aborts in a row and no alarm"

    def start_write(self, payload: Payload) -> None:
        """Publish ``payload``: at once, or -- delayed, or cut off from Kafka -- blocked until
        it lands or is given up (:meth:`finish_write`). Reading replies, it names the reply
        topic, and a CHECKPOINT says from where its replies are not reflected in it."""
        w = self.world
        reply_to = REPLY_TOPIC if self.replies_next is not None else ""
        if self.replies_next is not None and isinstance(payload, Checkpoint):
            payload = replace(payload, replies_from=self.replies_next)
        delay = w.delay()
        if not delay and w.reaches_kafka(self.name):
            self.events.append(self.publish(payload, self.epoch, reply_to))
            return
        self.inflight = (payload, w.now, w.now + delay, self.epoch, reply_to)
        w.seen["coordinator's write delayed" if delay else "coordinator's write blocked"] += 1
        if w.verbose:
            w.trace(f"{self.label} .. {_show(payload)} in flight for {delay} ms")

    def finish_write(self) -> None:
        """The blocked write ends: it lands (or is fenced, or fails) -- or, cut off from Kafka
        for PUBLISH_GIVE_UP_MS, the transaction is aborted and nothing lands."""
        assert self.inflight is not None
        w = self.world
        payload, _, _, epoch, reply_to = self.inflight
        self.inflight = None
        if w.reaches_kafka(self.name):
            self.feed(self.publish(payload, epoch, reply_to))
            return
        w.seen["coordinator's write given up"] += 1
        if w.verbose:
            w.trace(f"{self.label} !! {_show(payload)} given up: Kafka unreachable")
        self.feed(cm.PublishFailed(payload, w.now, "transaction timed out: Kafka unreachable"))

    def publish(self, payload: Payload, epoch: int, reply_to: str) -> cm.Event:
        w = self.world
        if epoch != w.epoch:
            self.fenced_writes += 1
            return cm.PublishFailed(payload, w.now, "producer fenced", fenced=True)
        if w.fault(w.p.p_publish_fail):
            return cm.PublishFailed(payload, w.now, "transaction aborted: broker timeout")
        w.append(self.label, payload, epoch=epoch, reply_to=reply_to)
        if isinstance(payload, Decision):
            if payload.outcome is Outcome.COMMIT:
                self.failed_run = 0
                for pos in payload.positions:
                    w.group_offsets[(pos.topic, pos.partition)] = pos.offset
            else:
                self.failed_run += 1
        return cm.Published(payload, w.now)

    def feed_partitions(self) -> None:
        """A metadata read: the source partitions, and whether the reply topic is there."""
        w = self.world
        self.reply_found = w.reply_topic_exists() and not self.old
        if self.reply_found and self.replies_next is None and self.recovered:
            self.open_replies()  # made since we took over
        tps = frozenset(w.tp(p) for p in range(w.coord_sees))
        self.feed(cm.SourcePartitions(tps, {tp: w.group_offsets.get(tp, 0) for tp in tps}))

    def open_replies(self) -> None:
        """Start reading the reply topic (leading, recovered, the topic found): from the latest
        replayed CHECKPOINT's ``replies_from``, else from its start."""
        w = self.world
        if self.replies_next is not None or not self.machine.is_leader or not self.recovered:
            return
        if not self.reply_found:
            return
        start = max(0, self.replies_checkpointed)
        self.replies_next = self.replies_start = start
        self.reply_lag = Lag(start, replies=True)
        if self.machine.phase is not cm.Phase.RECOVERING:
            w.seen["reply topic found mid-reign"] += 1
        elif start:
            w.seen["leader reads replies from a checkpoint's replies_from"] += 1
        else:
            w.seen["leader reads replies from the start"] += 1
        if w.verbose:
            w.trace(f"{self.label} reads replies from #{start}")

    def close_replies(self) -> None:
        self.replies_next = None

    def acquire(self) -> None:
        w = self.world
        w.epoch += 1
        w.leader = self
        self.epoch = w.epoch
        self.lost_at = None
        self.failed_run = 0
        self.alarmed = False
        self.cursor = w.latest_checkpoint()
        self.replay_end = len(w.log)
        self.lag = Lag(self.cursor)
        self.reading = True
        # A new reign reads replies from its own recovery's point.
        self.close_replies()
        self.recovered = False
        self.replies_checkpointed = -1
        self.replies_at_acquire = len(w.replies)
        if w.verbose:
            w.trace(f"== {self.label} wins leadership (epoch {self.epoch})")
        self.feed(cm.LeadershipAcquired(w.now))
        self.feed_partitions()
        if self.cursor >= self.replay_end:
            self.caught_up()

    def caught_up(self) -> None:
        self.recovered = True
        self.open_replies()  # before the machine writes anything: what it writes names the topic
        self.feed(cm.CaughtUp(self.world.now))

    def add_moves(self, out: list[tuple[int, Callable[[], None]]]) -> None:
        w = self.world
        if self.hold:
            return
        kafka = self.name not in w.kafka_cuts
        if self.inflight is not None:  # blocked in a write
            _, started, lands, _, _ = self.inflight
            if w.now >= (lands if kafka else started + PUBLISH_GIVE_UP_MS):
                out.append((5, self.finish_write))
            return
        if (
            self.reading
            and self.cursor < len(w.log)
            and kafka
            and self.cursor < self.lag.visible(w)
        ):
            out.append((5, self.read))
        if (
            self.replies_next is not None
            and self.replies_next < len(w.replies)
            and kafka
            and self.replies_next < self.reply_lag.visible(w)
        ):
            out.append((5, self.read_reply))
        if w.now >= self.next_tick:
            out.append((3, self.tick))
        if self.lost_at is not None and w.now >= self.lost_at and kafka:
            out.append((2, self.lose))

    def read(self) -> None:
        w = self.world
        env = w.deliver(w.log[self.cursor])
        k = self.replies_next
        if k is not None and k < len(w.replies) and w.reply_marks[k] <= self.cursor:
            w.seen["control message read ahead of a reply written before it"] += 1
        self.cursor += 1
        if not self.recovered and isinstance(env.payload, Checkpoint):
            # The log's order is the checkpoints' order: the last one replayed is the newest.
            here = env.reply_to == REPLY_TOPIC and env.payload.replies_from >= 0
            self.replies_checkpointed = env.payload.replies_from if here else -1
        self.feed(cm.Received(env, w.now))
        if self.cursor == self.replay_end and self.machine.phase is cm.Phase.RECOVERING:
            self.caught_up()

    def read_reply(self) -> None:
        """Hand one reply to the machine: only VOTE and APPLIED belong on the reply topic."""
        w = self.world
        k = self.replies_next
        assert k is not None
        env = w.deliver(w.replies[k])
        self.replies_next = k + 1
        msg = env.payload
        if w.reply_marks[k] > self.cursor:
            w.seen["reply read ahead of a control message written before it"] += 1
        if w.leader is not self:
            w.seen["deposed leader reads a reply"] += 1
        if not isinstance(msg, Vote | Applied):
            raise SimViolation(f"{self.label}: a {type(msg).__name__} on the reply topic")
        if (
            isinstance(msg, Applied)
            and k < self.replies_at_acquire
            and msg.txn in self.machine.log.pending
            and msg.part not in self.machine.log.pending[msg.txn].acked
        ):
            w.seen["APPLIED written before a takeover counted by the new leader"] += 1
        self.feed(cm.Received(env, w.now))

    def tick(self) -> None:
        w = self.world
        self.next_tick = w.now + TICK_MS
        if w.rng.random() < 0.1 and w.reaches_kafka(self.name):  # the metadata refresh
            self.feed_partitions()
        self.feed(cm.Tick(w.now))

    def lose(self) -> None:
        self.lost_at = None
        self.reading = False
        self.feed(cm.LeadershipLost(self.world.now, "lease expired"))


# -- the world ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    seed: int
    ok: bool
    error: str
    steps: int
    now_ms: int
    commits: int
    aborts: int
    records: int
    trace: list[str]

    def summary(self) -> str:
        return (
            f"after {self.steps} steps, {self.now_ms} ms: {self.records} records, "
            f"{self.commits} commits, {self.aborts} aborts"
        )


@dataclass(slots=True)
class KafkaCut:
    """An actor cut off from Kafka until ``until``; after ``session`` ms its group drops it."""

    start: int
    until: int
    session: int
    dropped: bool = False


class World:
    def __init__(
        self, seed: int, verbose: bool = False, wire: bool = False, params: Params | None = None
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.p = params if params is not None else Params.draw(self.rng)
        self.verbose = verbose
        self.wire = wire
        self.lines: list[str] = []
        self.now = 0
        self.steps = 0
        self.faults_on = True
        self.log: list[Envelope] = []
        self.log_epochs: list[int] = []
        self.log_times: list[int] = []
        self.log_view = LogView()
        self.checkpoints: list[int] = []
        #: The reply topic's partition 0, and when each reply landed: its time, and how long the
        #: control log was then (which fixes the landing order across the two topics).
        self.replies: list[Envelope] = []
        self.reply_times: list[int] = []
        self.reply_marks: list[int] = []
        #: The reply topic's variants draw from their own stream too (delays, upgrades).
        self.reply_rng = random.Random(seed + 3_000_003)
        self.old = {f"P{i}" for i in range(self.p.old_participants)}
        self.msg_id = 0
        self.stores = {name: Store(self, name) for name in STORES}
        #: Partitions by index: the first ``p.partitions`` are topic ``src``'s, then one topic
        #: per ``p.new_topics``, each seen by the group and the coordinator when they find it.
        self.total = self.p.partitions + self.p.new_topics
        self.index = {self.tp(i): i for i in range(self.total)}
        self.group_sees = self.coord_sees = self.p.partitions
        self.topic_rng = random.Random(seed + 1_000_003)
        self.hw = [0] * self.total
        #: Records consumers can fetch, per partition (``hw`` less those still on their way),
        #: and when each of the others arrives, in order.
        self.avail = [0] * self.total
        self.arriving: list[deque[int]] = [deque() for _ in range(self.total)]
        self.in_transit = 0
        #: Network faults draw from their own stream: a schedule without them is what it was.
        self.net = random.Random(seed + 2_000_003)
        self.kafka_cuts: dict[str, KafkaCut] = {}  # actor name -> its cut
        self.store_cuts: dict[tuple[str, str], int] = {}  # (participant name, store) -> until
        #: Writes of dead coordinators that reached the broker: (lands at, epoch, label, message,
        #: reply_to).
        self.landing: list[tuple[int, int, str, Payload, str]] = []
        #: How often each network fault and its consequences came up (the tests check that
        #: they do).
        self.seen: Counter[str] = Counter()
        self.records_left = self.p.records * (5 if self.p.drained else 1)
        self.group_offsets: dict[TP, int] = {}
        self.generation = 0
        self.members: dict[str, Participant] = {}
        self.assignment: dict[str, set[TP]] = {}
        self.departures: list[tuple[int, str]] = []  # (when, member_id)
        self.ghosts: list[tuple[str, deque[Outgoing]]] = []  # producers of dead processes
        self.epoch = 0
        self.leader: Coordinator | None = None
        self.alarms: list[tuple[str, cm.Alarm]] = []
        self.missing_alarm = ""
        self.restarts: list[tuple[int, str]] = []  # (when, name)
        self.rejoins: list[tuple[int, Participant]] = []  # kicked members noticing it
        self.lease_expiry: int | None = None
        #: How eagerly members handle a rebalance: low keeps slow members in the old generation.
        self.rebalance_weight = self.rng.choice((1, 3))
        self.coordinators = [Coordinator(self, f"C{i}", 0) for i in range(2)]
        #: Whether the runtime subscribes before its start-up replay is done (both are fine, as
        #: long as the assignment is handled after the start-up in-doubt listing).
        self.join_early = self.rng.random() < 0.3
        #: Whether an early member's data thread runs before the start-up in-doubt listing (the
        #: runtime's does not): the assignment may then reach the machine first, which must
        #: wait for the listing before it votes or writes.
        self.assign_early = self.join_early and random.Random(seed + 4_000_003).random() < 0.5
        self.participants = [Participant(self, f"P{i}", 0) for i in range(self.p.participants)]
        if verbose:
            at = self.p.reply_topic_at
            made = "none" if at < 0 else f"made at {at} ms" if at else "from the start"
            self.trace(
                f"== reply topic {made}; old participants: {sorted(self.old) or 'none'}"
                f"{'; old coordinator: C1' if self.p.old_coordinator else ''}"
            )
        self.coordinators[0].acquire()

    # -- utilities --

    def tp(self, i: int) -> TP:
        base = self.p.partitions
        return (TOPIC, i) if i < base else (f"{TOPIC}.new{i - base}", 0)

    def group_topics(self) -> tuple[str, ...]:
        """The topics the members subscribe to now (all alike: they re-read one list)."""
        return tuple(sorted({self.tp(i)[0] for i in range(self.group_sees)}))

    def find_topics(self, *, every: bool = False) -> None:
        """A created topic is found by the coordinator's metadata refresh and by the group's
        (a rebalance), each in its own time; ``every``: both find every topic now."""
        r = self.topic_rng
        if self.coord_sees < self.total and (every or r.random() < 0.01):
            self.coord_sees = self.total if every else self.coord_sees + 1
            if self.verbose:
                self.trace(f"== the coordinator's metadata shows {self.tp(self.coord_sees - 1)}")
        if self.group_sees < self.total and (every or r.random() < 0.01):
            self.group_sees = self.total if every else self.group_sees + 1
            if self.members:
                self.rebalance_group(f"subscribed to {self.group_topics()[-1]}")

    def trace(self, line: str) -> None:
        self.lines.append(f"[{self.now:6d}] {line}")

    def fault(self, p: float) -> bool:
        return self.faults_on and p > 0 and self.rng.random() < p

    def delay(self, rng: random.Random | None = None) -> int:
        """How late one message (control or data) arrives."""
        p = self.p
        r = self.net if rng is None else rng
        if not (self.faults_on and p.delay_ms) or r.random() >= p.p_delay:
            return 0
        return r.randint(1, p.delay_ms)

    def reaches_kafka(self, name: str) -> bool:
        return name not in self.kafka_cuts

    def reaches_store(self, name: str, store: str) -> bool:
        return (name, store) not in self.store_cuts

    def join_when_reachable(self, proc: Participant) -> None:
        """Subscribe: the group sees the member once its consumer reaches Kafka."""
        cut = self.kafka_cuts.get(proc.name)
        if cut is None:
            self.group_join(proc)
            return
        proc.joined = True
        self.rejoins.append((cut.until + self.net.randint(0, 50), proc))

    def latest_checkpoint(self) -> int:
        return self.checkpoints[-1] if self.checkpoints else 0

    def reply_topic_exists(self) -> bool:
        return 0 <= self.p.reply_topic_at <= self.now

    def land(self, sender: str, out: Outgoing) -> Envelope:
        """A participant's message reaches the broker, on the topic it was sent to."""
        if not out.topic:
            if isinstance(out.msg, Vote | Applied) and sender.split("-")[0] in self.old:
                self.seen["old participant's reply on the control topic"] += 1
            return self.append(sender, out.msg)
        self.msg_id += 1
        env = Envelope(f"m{self.msg_id}", PIPELINE, sender, self.now, out.msg)
        self.replies.append(env)
        self.reply_times.append(self.now)
        self.reply_marks.append(len(self.log))
        self.seen[f"{type(out.msg).__name__.upper()} on the reply topic"] += 1
        if isinstance(out.msg, Vote) and out.msg.txn in self.log_view.decisions:
            self.seen["vote lands after its decision"] += 1
        if self.verbose:
            self.trace(f"REPLY #{len(self.replies) - 1} from {sender}: {_show(out.msg)}")
        return env

    def landed(self) -> Iterator[Envelope]:
        """Both topics' messages in the order they landed."""
        k = 0
        for i, env in enumerate(self.log):
            while k < len(self.replies) and self.reply_marks[k] <= i:
                yield self.replies[k]
                k += 1
            yield env
        yield from self.replies[k:]

    def append(
        self, sender: str, payload: Payload, epoch: int = -1, reply_to: str = ""
    ) -> Envelope:
        self.msg_id += 1
        env = Envelope(f"m{self.msg_id}", PIPELINE, sender, self.now, payload, reply_to=reply_to)
        if isinstance(payload, Checkpoint):
            self.checkpoints.append(len(self.log))
        self.log.append(env)
        self.log_epochs.append(epoch)
        self.log_times.append(self.now)
        if isinstance(payload, Vote) and payload.txn in self.log_view.decisions:
            self.seen["vote lands after its decision"] += 1
        if isinstance(payload, Decision) and self.in_transit:
            self.seen["decision ahead of a record produced before it"] += 1
        if isinstance(payload, Decision):
            first = self.log_view.decisions.get(payload.txn)
            if first is not None and (first.outcome, first.parts, first.positions) != (
                payload.outcome,
                payload.parts,
                payload.positions,
            ):
                raise SimViolation(f"two different decisions for txn {payload.txn}")
        self.log_view.apply(env)
        if self.verbose:
            to = " [reply_to]" if reply_to else ""
            self.trace(f"LOG #{len(self.log) - 1} from {sender}{to}: {_show(payload)}")
        return env

    def deliver(self, env: Envelope) -> Envelope:
        if not self.wire:
            return env
        from twophase.protocol import codec

        value, headers = codec.encode(env)
        return codec.decode(value, headers, pipeline=PIPELINE)

    def list_in_doubt(self) -> tuple[tuple[str, int, str], ...]:
        return tuple(
            (s, txn, participant)
            for s in STORES
            for txn, participant in sorted(self.stores[s].in_doubt())
        )

    # -- the consumer group --

    def group_join(self, proc: Participant) -> None:
        proc.joined = True
        self.members[proc.member_id] = proc
        self.rebalance_group("join " + proc.member_id)

    def rebalance_group(self, why: str) -> None:
        self.generation += 1
        ids = sorted(self.members)
        self.rng.shuffle(ids)
        self.assignment = {m: set() for m in ids}
        if ids:
            for p in range(self.group_sees):
                self.assignment[ids[p % len(ids)]].add(self.tp(p))
        if self.verbose:
            pretty = {m: sorted(p for _, p in tps) for m, tps in sorted(self.assignment.items())}
            self.trace(f"== rebalance to generation {self.generation} ({why}): {pretty}")
        for proc in self.members.values():
            if proc.alive:
                proc.rebalance = 1 if proc.machine.assigned or proc.rebalance == 1 else 2

    def kick(self, proc: Participant) -> None:
        """The group drops a live member (a long pause, max.poll.interval exceeded) that does not
        know it yet: it keeps working in its old generation until it notices and rejoins."""
        del self.members[proc.member_id]
        self.rebalance_group(f"kicked {proc.member_id}")
        self.rejoins.append((self.now + self.rng.randint(50, 400), proc))

    # -- faults --

    def crash_participant(self, proc: Participant, why: str = "") -> None:
        """kill -9; or, with ``why``, the process exits on an error it cannot go on after."""
        if self.verbose:
            self.trace(
                f"!! {'crash' if not why else 'exit'} {proc.member_id}{': ' + why if why else ''}"
            )
        proc.alive = False
        if why:
            self.seen["participant exits"] += 1
        for s in self.stores.values():
            s.abandon(proc.owner)
        # Cut off, it sent nothing: its queue dies with it.
        sent = (
            self.rng.randint(0, len(proc.outbox))
            if not why and self.reaches_kafka(proc.name)
            else 0
        )
        if sent:
            self.ghosts.append((proc.member_id, deque(list(proc.outbox)[:sent])))
        if proc.joined:
            self.departures.append(
                (self.now + self.rng.randint(*SESSION_TIMEOUT_MS), proc.member_id)
            )
        self.restarts.append((self.now + self.rng.randint(*RESTART_MS), proc.name))

    def restart(self, name: str) -> None:
        if name.startswith("P"):
            i = int(name[1:])
            old = self.participants[i]
            if name in self.old and self.reply_rng.random() < 0.3:
                self.old.discard(name)  # a rolling upgrade
                self.seen["old participant upgraded"] += 1
            self.participants[i] = Participant(self, name, old.incarnation + 1)
            if self.verbose:
                self.trace(f"!! restart {self.participants[i].member_id}")
        else:
            i = int(name[1:])
            old_c = self.coordinators[i]
            self.coordinators[i] = Coordinator(self, name, old_c.incarnation + 1)
            if self.verbose:
                self.trace(f"!! restart {self.coordinators[i].label} as standby")

    def crash_coordinator(self, c: Coordinator) -> None:
        if self.verbose:
            self.trace(f"!! crash {c.label}")
        c.alive = False
        if c.inflight is not None and self.reaches_kafka(c.name) and self.net.random() < 0.5:
            # The commit of its Kafka transaction reached the broker before the process died.
            payload, _, lands, epoch, reply_to = c.inflight
            self.landing.append((lands, epoch, c.label, payload, reply_to))
            self.seen["coordinator killed in a write that still lands"] += 1
        if self.leader is c:
            self.leader = None
            self.lease_expiry = self.now + self.rng.randint(*LEASE_MS)
        self.restarts.append((self.now + self.rng.randint(*RESTART_MS), c.name))

    def depose(self) -> None:
        """The standby takes over while the leader still runs (a long pause, a partition)."""
        old = self.leader
        standby = next((c for c in self.coordinators if c is not old and c.can_lead()), None)
        if old is None or standby is None:
            return
        if self.verbose:
            self.trace(f"!! {old.label} deposed while still running")
        if self.rng.random() < 0.5:
            old.lost_at = self.now + self.rng.randint(0, 500)
        standby.acquire()

    def cut_off(self) -> None:
        """A partition: a participant cut off from Kafka, from one or both stores, or both; or a
        coordinator (the leader, mostly) cut off from Kafka. Heals by itself."""
        n = self.net
        until = self.now + n.randint(*CUT_MS)
        if n.random() < 0.25:
            c = self.leader if self.leader is not None and n.random() < 0.8 else None
            name = c.name if c is not None else n.choice(self.coordinators).name
            self.seen["leader cut off from Kafka" if c else "coordinator cut off from Kafka"] += 1
            self.cut_kafka(name, until, n.randint(*LEASE_MS))
            return
        name = n.choice(self.participants).name
        what = n.choice(("kafka", "store", "store", "both"))
        self.seen[f"participant cut off from {what}"] += 1
        if what != "store":
            self.cut_kafka(name, until, n.randint(*SESSION_TIMEOUT_MS))
        if what != "kafka":
            for s in n.choice((("pg",), ("mongo",), STORES)):
                self.store_cuts[(name, s)] = max(until, self.store_cuts.get((name, s), 0))
                if self.verbose:
                    self.trace(f"!! {name} cut off from {s} until {until}")

    def cut_kafka(self, name: str, until: int, session: int) -> None:
        old = self.kafka_cuts.get(name)
        if old is not None:
            old.until = max(old.until, until)
        else:
            self.kafka_cuts[name] = KafkaCut(self.now, until, session)
        if self.verbose:
            self.trace(f"!! {name} cut off from Kafka until {self.kafka_cuts[name].until}")

    def network(self) -> None:
        """Records arriving, partitions healing, and what a partition leads to: a group that
        drops the member it cannot hear, a producer that gives up."""
        if not (self.in_transit or self.store_cuts or self.kafka_cuts or self.landing):
            return
        now = self.now
        if self.in_transit:
            for i, q in enumerate(self.arriving):
                while q and q[0] <= now:
                    q.popleft()
                    self.avail[i] += 1
                    self.in_transit -= 1
        for key in [k for k, until in self.store_cuts.items() if until <= now]:
            del self.store_cuts[key]
            if self.verbose:
                self.trace(f"!! {key[0]} reaches {key[1]} again")
        for name, cut in list(self.kafka_cuts.items()):
            if cut.until <= now:
                del self.kafka_cuts[name]
                if self.verbose:
                    self.trace(f"!! {name} reaches Kafka again")
            elif not cut.dropped and now >= cut.start + cut.session:
                cut.dropped = True
                self.session_lost(name, cut)
        for proc in self.participants:
            if (
                proc.alive
                and proc.outbox
                and not self.reaches_kafka(proc.name)
                and now - proc.outbox[0].queued >= PUBLISH_GIVE_UP_MS
            ):
                self.crash_participant(proc, why="a control message could not be delivered")
        if self.landing:
            due = [x for x in self.landing if x[0] <= now]
            self.landing = [x for x in self.landing if x[0] > now]
            for _, epoch, label, payload, reply_to in due:
                self.seen[
                    f"dead coordinator's write {'lands' if epoch == self.epoch else 'fenced'}"
                ] += 1
                if epoch == self.epoch:  # else the new leader's producer fenced it
                    self.append(label, payload, epoch=epoch, reply_to=reply_to)
                    if isinstance(payload, Decision) and payload.outcome is Outcome.COMMIT:
                        for pos in payload.positions:
                            self.group_offsets[(pos.topic, pos.partition)] = pos.offset

    def session_lost(self, name: str, cut: KafkaCut) -> None:
        """No heartbeat for a session timeout: the group goes on without the member."""
        if name.startswith("C"):
            c = self.coordinators[int(name[1:])]
            if self.leader is not c or not c.alive:
                return
            self.seen["leader loses the control partition"] += 1
            if self.verbose:
                self.trace(f"!! {c.label} loses the control partition (no heartbeat)")
            # It hears of it once it reaches Kafka again -- or only from being fenced.
            c.lost_at = cut.until + self.net.randint(0, 100) if self.net.random() < 0.5 else None
            standby = next((x for x in self.coordinators if x is not c and x.can_lead()), None)
            if standby is not None:
                standby.acquire()  # the new epoch fences whatever the old leader still writes
            else:
                self.leader, self.lease_expiry = None, self.now
            return
        proc = self.participants[int(name[1:])]
        if proc.alive and proc.member_id in self.members:
            self.seen["participant dropped by the group"] += 1
            del self.members[proc.member_id]
            self.rebalance_group(f"{proc.member_id} unreachable")
            self.rejoins.append((cut.until + self.net.randint(0, 100), proc))

    # -- the scheduler --

    def moves(self) -> list[tuple[int, Callable[[], None]]]:
        moves: list[tuple[int, Callable[[], None]]] = []
        for c in self.coordinators:
            if c.alive:
                c.add_moves(moves)
        for proc in self.participants:
            if proc.alive:
                proc.add_moves(moves)
        if self.ghosts:
            moves.append((2, self.flush_ghost))
        if self.records_left and self.rng.random() < 0.2:
            moves.append((2, self.produce))
        if self.faults_on:
            moves.append((1, self.maybe_fault))
        return moves

    def flush_ghost(self) -> None:
        i = self.rng.randrange(len(self.ghosts))
        sender, q = self.ghosts[i]
        self.land(sender, q.popleft())
        if not q:
            self.ghosts.pop(i)

    def produce(self) -> None:
        self.records_left -= 1
        i = self.rng.randrange(self.total)
        self.hw[i] += 1
        delay, q = self.delay(), self.arriving[i]
        if not delay and not q:
            self.avail[i] += 1
        else:  # in order within the partition; other partitions and topics go their own pace
            self.seen["record delayed"] += 1
            q.append(max(q[-1] if q else 0, self.now + delay))
            self.in_transit += 1

    def maybe_fault(self) -> None:
        p = self.p
        r = self.rng
        live = [x for x in self.participants if x.alive]
        if live and r.random() < p.p_crash_participant * 10:
            self.crash_participant(r.choice(live))
        if self.leader is not None and r.random() < p.p_crash_coordinator * 10:
            self.crash_coordinator(self.leader)
        if r.random() < p.p_depose * 10:
            self.depose()
        if self.members and r.random() < p.p_rebalance * 10:
            self.rebalance_group("random")
        if self.members and r.random() < p.p_kick * 10:
            self.kick(self.members[r.choice(sorted(self.members))])
        if p.p_cut and self.net.random() < p.p_cut * 10:
            self.cut_off()
        if r.random() < p.p_duplicate * 10:
            readers: list[Any] = [x for x in live if x.caught_up] + [
                c for c in self.coordinators if c.alive and c.reading and c.cursor > c.replay_end
            ]
            # A coordinator reading replies may get some again too (never below its start).
            replies = [
                c
                for c in self.coordinators
                if c.alive and c.replies_next is not None and c.replies_next > c.replies_start
            ]
            if readers or replies:
                i = r.randrange(len(readers) + len(replies))
                back = r.randint(1, 3)
                if i < len(readers):
                    who = readers[i]
                    who.cursor = max(who.replay_end, who.cursor - back)
                else:
                    c = replies[i - len(readers)]
                    assert c.replies_next is not None
                    c.replies_next = max(c.replies_start, c.replies_next - back)

    def timers(self) -> None:
        """Things that happen at a time: session timeouts, restarts, lease expiry."""
        now = self.now
        self.network()
        if self.departures and any(t <= now for t, _ in self.departures):
            gone = [m for t, m in self.departures if t <= now]
            self.departures = [(t, m) for t, m in self.departures if t > now]
            for m in gone:
                self.members.pop(m, None)
            self.rebalance_group("session timeout " + ", ".join(gone))
        if self.rejoins and any(t <= now for t, _ in self.rejoins):
            due_procs = [x for t, x in self.rejoins if t <= now]
            self.rejoins = [(t, x) for t, x in self.rejoins if t > now]
            for proc in due_procs:
                if proc.alive and proc.member_id not in self.members:
                    if self.verbose:
                        self.trace(f"!! {proc.member_id} notices it was dropped from the group")
                    self.join_when_reachable(proc)
        if self.restarts and any(t <= now for t, _ in self.restarts):
            due = [n for t, n in self.restarts if t <= now]
            self.restarts = [(t, n) for t, n in self.restarts if t > now]
            for n in due:
                self.restart(n)
        if self.leader is None and (self.lease_expiry is None or now >= self.lease_expiry):
            alive = [c for c in self.coordinators if c.can_lead()]
            if alive:
                self.lease_expiry = None
                self.rng.choice(alive).acquire()

    def step(self) -> bool:
        self.steps += 1
        self.now += self.rng.randint(0, 4)
        self.timers()
        if self.faults_on:
            self.find_topics()
        moves = self.moves()
        if not moves:
            self.now += self.rng.randint(5, 20)  # nothing to do until a timer fires
            return False
        total = 0
        for w, _ in moves:
            total += w
        x = self.rng.random() * total
        for w, fn in moves:
            x -= w
            if x < 0:
                fn()
                break
        else:
            moves[-1][1]()
        return True

    # -- the run --

    def done(self) -> bool:
        if self.records_left or self.restarts or self.departures or self.ghosts or self.rejoins:
            return False
        if self.kafka_cuts or self.store_cuts or self.landing:
            return False
        if any(self.group_offsets.get(self.tp(p), 0) != hw for p, hw in enumerate(self.hw)):
            return False
        if any(s.in_doubt() for s in self.stores.values()):
            return False
        return not self.log_view.pending

    def run(self) -> Result:
        error = seeds.play(self, SimViolation)
        commits = sum(1 for d in self.log_view.decisions.values() if d.outcome is Outcome.COMMIT)
        return Result(
            self.seed,
            not error,
            error,
            self.steps,
            self.now,
            commits,
            len(self.log_view.decisions) - commits,
            sum(self.hw),
            self.lines,
        )

    def quiesce(self) -> None:
        """Faults off, everything restarted, all records produced; run until all is committed
        and nothing is prepared, or fail with what is stuck."""
        self.faults_on = False
        if self.verbose:
            self.trace("== faults off: driving to quiescence")
        self.find_topics(every=True)
        for proc in self.participants:
            if not proc.alive:
                self.restarts = [(t, n) for t, n in self.restarts if n != proc.name]
                self.restart(proc.name)
        for c in self.coordinators:
            if not c.alive:
                self.restarts = [(t, n) for t, n in self.restarts if n != c.name]
                self.restart(c.name)
        for st in self.stores.values():
            st.fail_next = 0
        deadline = self.now + self.p.quiesce_ms
        while self.records_left:
            self.produce()
        while self.steps % 8 or not self.done():
            if self.now > deadline or self.steps > self.p.max_steps:
                raise SimViolation(f"no quiescence: {self.stuck()}")
            self.step()

    def run_until(self, pred: Callable[[], bool], max_steps: int = 20_000) -> None:
        """Step until ``pred()`` holds (for hand-written scenarios)."""
        for _ in range(max_steps):
            if pred():
                return
            self.step()
        raise SimViolation(f"condition not reached in {max_steps} steps")

    def stuck(self) -> str:
        bits = []
        lag = {p: (self.group_offsets.get(self.tp(p), 0), hw) for p, hw in enumerate(self.hw)}
        bits.append(f"offsets/hw {lag}")
        for s in self.stores.values():
            if s.in_doubt():
                bits.append(f"{s.name} prepared {sorted(s.in_doubt())}")
        if self.log_view.pending:
            bits.append(f"pending {sorted(self.log_view.pending)}")
        leader = self.leader
        bits.append(f"leader {leader.label + ' ' + leader.machine.phase.value if leader else None}")
        if self.kafka_cuts or self.store_cuts:
            bits.append(f"cut off: {sorted(self.kafka_cuts)} {sorted(self.store_cuts)}")
        return "; ".join(bits)

    # -- the guarantees --

    def check(self) -> None:
        # Fencing: once a leader of some epoch has written, no older epoch's write lands.
        newest = -1
        for i, epoch in enumerate(self.log_epochs):
            if epoch >= 0:
                if epoch < newest:
                    raise SimViolation(
                        f"(5) log #{i} written by epoch {epoch} after epoch {newest}"
                    )
                newest = epoch
        tps = [self.tp(p) for p in range(self.total)]
        prev = {tp: 0 for tp in tps}
        decided: dict[int, Decision] = {}
        votes: dict[int, list[Vote]] = {}
        committed_keys: set[tuple[int, str]] = set()
        # Votes in the order they landed, on either topic: per writer, the order it sent them.
        for env in self.landed():
            msg = env.payload
            if isinstance(msg, Prepare):
                votes[msg.txn] = []  # the leader that prepared counts votes read after this
                continue
            if isinstance(msg, Vote):
                votes.setdefault(msg.txn, []).append(msg)
                continue
            if not isinstance(msg, Decision):
                continue
            first = decided.get(msg.txn)
            if first is not None:
                if (first.outcome, first.parts, first.positions) != (
                    msg.outcome,
                    msg.parts,
                    msg.positions,
                ):
                    raise SimViolation(f"(5) two different decisions for txn {msg.txn}")
                continue
            decided[msg.txn] = msg
            if msg.outcome is not Outcome.COMMIT:
                continue
            named = {(p.topic, p.partition): p.offset for p in msg.positions}
            # A topic no commit has named yet keeps its start (0); once named, always named.
            if not set(named) <= set(tps) or any(tp not in named and prev[tp] for tp in tps):
                raise SimViolation(f"(3) commit {msg.txn} positions name {sorted(named)}")
            new = {tp: named.get(tp, prev[tp]) for tp in tps}
            if any(new[tp] < prev[tp] for tp in tps):
                raise SimViolation(f"(3) commit {msg.txn} moves back: {_moves(prev, new)}")
            self._check_votes(msg, votes.get(msg.txn, []), prev, new)
            for s in STORES:
                store = self.stores[s]
                got: list[tuple[int, int]] = []
                for part in msg.parts:
                    if s not in part.sinks:
                        continue
                    key = (msg.txn, part.participant)
                    sp = store.parts.get(key)
                    if sp is None or sp.state != COMMITTED:
                        raise SimViolation(
                            f"(2) part {key} of commit {msg.txn} is "
                            f"{sp.state if sp else 'missing'} in {s}"
                        )
                    committed_keys.add(key)
                    got += sp.records
                want = sorted(
                    (self.index[tp], o) for tp, end in new.items() for o in range(prev[tp], end)
                )
                if sorted(got) != want:
                    raise SimViolation(
                        f"(1) commit {msg.txn} in {s}: records {_ranges(got)} but the positions "
                        f"moved {_moves(prev, new)}"
                    )
            prev = new
        for s in STORES:
            for key, sp in self.stores[s].parts.items():
                if sp.state == COMMITTED and key not in committed_keys:
                    raise SimViolation(f"(1) part {key} committed in {s} without a commit decision")
                if sp.state == PREPARED:
                    raise SimViolation(f"(6) part {key} still prepared in {s}")
        final = {tp: prev[tp] for tp in tps}
        if any(self.group_offsets.get(tp, 0) != off for tp, off in final.items()):
            raise SimViolation(f"(3) group offsets {self.group_offsets} != positions {final}")
        if self.missing_alarm:
            raise SimViolation("(7) " + self.missing_alarm)
        self._check_replies()

    def _check_replies(self) -> None:
        """(8) Replies go where the coordinator reads them: with every coordinator message
        naming the reply topic and no participant of an older version, none is on the control
        topic (what a participant sends before it has read any coordinator message -- nothing
        -- would be). Each send is checked against the latest message read too (Participant)."""
        if self.p.old_participants:
            return
        announced = [e.reply_to for e in self.log if isinstance(e.payload, COORDINATOR_MESSAGES)]
        if not announced or not all(announced):
            return
        for env in self.log:
            if isinstance(env.payload, Vote | Applied):
                raise SimViolation(
                    f"(8) {_show(env.payload)} from {env.sender} on the control topic, though "
                    "every coordinator message named the reply topic"
                )

    def _check_votes(
        self, d: Decision, votes: list[Vote], prev: dict[TP, int], new: dict[TP, int]
    ) -> None:
        counted: list[Vote] = []
        for part in d.parts:
            # The leader counts the first vote it reads from a participant -- or a later
            # generation's vote replacing an idle first one (no partitions, nothing prepared),
            # if it read that one before deciding; any other different vote makes it abort.
            # So the part must match the first vote or one that may replace it.
            first: Vote | None = None
            for v in votes:
                if v.participant != part.participant:
                    continue
                if first is None or (
                    first.vote is VoteValue.PREPARED
                    and not first.partitions
                    and not first.sinks
                    and v.vote is VoteValue.PREPARED
                    and v.generation > first.generation
                    and first.generation != part.generation
                ):
                    first = v
            if (
                first is None
                or first.vote is not VoteValue.PREPARED
                or first.generation != part.generation
                or first.sinks != part.sinks
            ):
                raise SimViolation(f"(5) commit {d.txn} names {part} but its vote is {first}")
            counted.append(first)
        busy = [v for v in counted if v.partitions]
        if len({v.generation for v in busy}) > 1:
            raise SimViolation(f"(5) commit {d.txn} counted votes of several generations")
        seen: dict[TP, tuple[int, int]] = {}
        for v in busy:
            for pr in v.partitions:
                tp = (pr.topic, pr.partition)
                if tp in seen:
                    raise SimViolation(f"(5) commit {d.txn}: {tp} covered twice")
                seen[tp] = (pr.start, pr.end)
        # What no vote covered (a topic nobody reads yet) must not have moved.
        want = {tp: (prev[tp], new[tp]) for tp in new if tp in seen or new[tp] != prev[tp]}
        if seen != want:
            raise SimViolation(f"(5) commit {d.txn}: votes cover {seen}, positions moved {want}")


# -- formatting ---------------------------------------------------------------------------------


def _ranges(recs: list[tuple[int, int]]) -> str:
    by: dict[int, list[int]] = {}
    for p, o in sorted(recs):
        by.setdefault(p, []).append(o)
    return "{" + ", ".join(f"{p}: {offs}" for p, offs in sorted(by.items())) + "}"


def _moves(prev: dict[TP, int], new: dict[TP, int]) -> str:
    return "{" + ", ".join(f"{p}: {prev[(t, p)]}->{o}" for (t, p), o in sorted(new.items())) + "}"


def _show(x: Any) -> str:
    """A compact one-line rendering of an event, action or payload for traces."""
    if isinstance(x, pm.Received | cm.Received):
        return (
            f"Received({_show(x.env.payload)}{', replay' if getattr(x, 'replay', False) else ''})"
        )
    if isinstance(x, Prepare):
        return f"PREPARE {x.txn}"
    if isinstance(x, Vote):
        ranges = " ".join(f"{p.partition}:[{p.start},{p.end})" for p in x.partitions)
        return (
            f"VOTE {x.txn} {x.participant} g{x.generation} {x.vote.value} {ranges} "
            f"sinks={','.join(x.sinks) or '-'}{' ' + x.reason if x.reason else ''}"
        )
    if isinstance(x, Decision):
        if x.outcome is Outcome.ABORT:
            return f"DECISION {x.txn} abort ({x.reason})"
        parts = ",".join(f"{p.participant}{'' if p.sinks else '(idle)'}" for p in x.parts)
        pos = " ".join(f"{p.partition}:{p.offset}" for p in x.positions)
        return f"DECISION {x.txn} commit [{parts}] {pos}"
    if isinstance(x, Applied):
        return f"APPLIED {x.txn} {x.part} by {x.applied_by}"
    if isinstance(x, Complete):
        return f"COMPLETE {x.txn}"
    if isinstance(x, Checkpoint):
        pend = ",".join(str(p.txn) for p in x.pending)
        since = f" replies_from={x.replies_from}" if x.replies_from >= 0 else ""
        return f"CHECKPOINT last={x.last_txn} pending=[{pend}]{since}"
    if isinstance(x, cm.Publish):
        return f"Publish({_show(x.payload)})"
    if isinstance(x, cm.Published | cm.PublishFailed):
        extra = "" if isinstance(x, cm.Published) else f" {x.reason} fenced={x.fenced}"
        return f"{type(x).__name__}({_show(x.payload)}{extra})"
    if isinstance(x, pm.SendVote):
        return f"SendVote({_show(x.vote)})"
    if isinstance(x, pm.SendApplied):
        return f"SendApplied({_show(x.applied)})"
    if isinstance(x, pm.Written):
        b = " ".join(f"{p}:{v[0]}/{v[1]}" for (_, p), v in sorted(x.batch.items()))
        return f"Written({x.txn}, {b})"
    if isinstance(x, pm.Seek | pm.Assigned):
        offs = " ".join(f"{p}:{o}" for (_, p), o in sorted(x.offsets.items()))
        if isinstance(x, pm.Assigned):
            return f"Assigned(g{x.generation} {x.member_id} {offs})"
        return f"Seek({offs})"
    if isinstance(x, pm.PreparePart):
        if not x.ready:
            return f"PreparePart({x.txn}, cut please)"
        offs = " ".join(f"{p}:{o}" for (_, p), o in sorted(x.positions.items()))
        return f"PreparePart({x.txn}, ready, {offs}, sinks={','.join(x.sinks) or '-'})"
    if isinstance(x, pm.InDoubt):
        return f"InDoubt({', '.join(f'{s}/{t}/{p}' for s, t, p in x.parts)}{', sweep' if x.sweep else ''})"
    if isinstance(x, pm.Log | cm.Log):
        return f"log {x.level}: {x.message}{f' (txn {x.txn})' if x.txn else ''}"
    return repr(x)


# -- entry points -------------------------------------------------------------------------------


def run(seed: int, verbose: bool = False, wire: bool = False) -> Result:
    return World(seed, verbose=verbose, wire=wire).run()


if __name__ == "__main__":
    sys.exit(seeds.main(__doc__, "tests.sim.world", run))
