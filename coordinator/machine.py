"""The coordinator's decisions as a pure state machine: events in, actions out, no I/O.

The Kafka adapter (:mod:`twophase.coordinator.runtime`) feeds it what happened -- leadership won or lost,
control messages read, the source partition set, timer ticks, whether a write landed -- and does
what it returns. The deterministic simulator drives the very same class.

One commit cycle::

    IDLE --interval, or DRAINED hints covering every partition--> PREPARE(T) published
         --> COLLECTING votes
    COLLECTING --votes of one generation cover every partition exactly once,
                 each starting at the committed position--> DECISION(T, commit)
    COLLECTING --an abort vote, a generation conflict, an overlap, a broken chain,
                 or the vote deadline--> DECISION(T, abort)
    DECIDING --write confirmed--> IDLE (and COMPLETE / CHECKPOINT when due)

Every message is published inside the coordinator's Kafka transaction under a stable
``transactional.id``, so a deposed coordinator is fenced by Kafka and can publish nothing at all.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from twophase.protocol.logview import LogView
from twophase.protocol.messages import (
    Applied,
    Checkpoint,
    Complete,
    Decision,
    Drained,
    Envelope,
    Outcome,
    Part,
    Payload,
    Position,
    Prepare,
    Vote,
    VoteValue,
)

__all__ = [
    "Action",
    "Alarm",
    "CaughtUp",
    "CoordinatorMachine",
    "CoordinatorSettings",
    "Event",
    "LeadershipAcquired",
    "LeadershipLost",
    "Log",
    "Phase",
    "Publish",
    "PublishFailed",
    "Published",
    "Received",
    "Skipped",
    "SourcePartitions",
    "StepDown",
    "Tick",
]

TP = tuple[str, int]


@dataclass(frozen=True, slots=True)
class CoordinatorSettings:
    commit_interval_ms: int = 1000
    vote_timeout_ms: int = 10_000
    #: Consecutive failed cycles before the alarm is raised (and kept raised until one commits).
    max_failed_cycles: int = 5
    #: Decisions between checkpoints: bounds the tail a recovering reader must fold.
    checkpoint_every: int = 20
    #: Back-off before re-publishing after a failed (non-fencing) write.
    publish_retry_ms: int = 500
    #: A cycle starts before the interval when DRAINED hints sent after the last PREPARE cover
    #: every source partition and hold at least this many records together; 0: never early.
    early_min_records: int = 0


# -- events ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tick:
    now_ms: int


@dataclass(frozen=True, slots=True)
class LeadershipAcquired:
    """This instance owns the pipeline; the adapter now replays the log tail as Received events."""

    now_ms: int


@dataclass(frozen=True, slots=True)
class LeadershipLost:
    now_ms: int
    reason: str


@dataclass(frozen=True, slots=True)
class Received:
    env: Envelope
    now_ms: int


@dataclass(frozen=True, slots=True)
class CaughtUp:
    """The replay reached the end of the control topic."""

    now_ms: int


@dataclass(frozen=True, slots=True)
class SourcePartitions:
    """Every partition of the source topics, and the group's committed offsets as a fallback for
    partitions no decision has named yet."""

    partitions: frozenset[TP]
    group_offsets: Mapping[TP, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Published:
    payload: Payload
    now_ms: int


@dataclass(frozen=True, slots=True)
class PublishFailed:
    payload: Payload
    now_ms: int
    reason: str
    fenced: bool = False


Event = (
    Tick
    | LeadershipAcquired
    | LeadershipLost
    | Received
    | CaughtUp
    | SourcePartitions
    | Published
    | PublishFailed
)

# -- actions -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Publish:
    """Write ``payload`` on the control topic inside a Kafka transaction, then report back with
    Published/PublishFailed. A commit DECISION also commits the source group's offsets to its
    positions in the same Kafka transaction."""

    payload: Payload


@dataclass(frozen=True, slots=True)
class Alarm:
    """Raised (``active``) after max_failed_cycles consecutive failures; cleared on a commit."""

    active: bool
    failed_cycles: int
    message: str


@dataclass(frozen=True, slots=True)
class StepDown:
    reason: str


@dataclass(frozen=True, slots=True)
class Log:
    level: str  # "info" | "warning" | "error"
    message: str
    txn: int = 0


@dataclass(frozen=True, slots=True)
class Skipped:
    """A control message read but not acted on, because it cannot follow from the log (``kind``
    ``out_of_sequence``): counted with the skips the reader makes and logged."""

    kind: str
    message: str
    txn: int = 0


Action = Publish | Alarm | StepDown | Log | Skipped


class Phase(enum.Enum):
    STANDBY = "standby"
    RECOVERING = "recovering"
    IDLE = "idle"
    COLLECTING = "collecting"
    DECIDING = "deciding"


@dataclass(slots=True)
class Cycle:
    txn: int
    started_ms: int
    deadline_ms: int
    votes: dict[str, Vote] = field(default_factory=dict)
    prepare_landed: bool = False


class CoordinatorMachine:
    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self.partitions: frozenset[TP] = frozenset()
        self.recheck = False
        self.group_offsets: dict[TP, int] = {}
        self._reset()

    def _reset(self) -> None:
        """Forget everything but configuration and the partition set: the log is the only truth."""
        self.phase = Phase.STANDBY
        self.log = LogView(prepare_in_sequence=True)
        self.cycle: Cycle | None = None
        self.deciding: Decision | None = None
        self.next_cycle_ms = 0
        #: The latest DRAINED hint of each participant (advisory: only ever starts a cycle early).
        self.drained: dict[str, Drained] = {}
        self.retry_at_ms = 0
        self.outbox: Payload | None = None  # a publish to retry after a transient failure
        self.failed_cycles = 0
        self.alarm = False
        self.decisions_since_checkpoint = 0
        # Figures for status/metrics; the adapter reads them, the machine never acts on them.
        self.committed = 0
        self.aborted = 0
        self.last_commit_ms = 0
        self.last_cycle_ms = 0
        self.early_cycles = 0

    # -- queries -------------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        return self.phase not in (Phase.STANDBY,)

    @property
    def current_txn(self) -> int:
        return self.cycle.txn if self.cycle else 0

    # -- the one entry point -------------------------------------------------------------------

    def handle(self, event: Event) -> list[Action]:
        if isinstance(event, LeadershipAcquired):
            return self._on_leadership(event)
        if isinstance(event, LeadershipLost):
            return self._step_down(event.reason)
        if isinstance(event, SourcePartitions):
            # A cycle waiting on partitions the metadata did not show is looked at again.
            self.recheck = self.recheck or event.partitions != self.partitions
            self.partitions = event.partitions
            self.group_offsets = dict(event.group_offsets)
            return []
        if self.phase is Phase.STANDBY:
            return []
        if isinstance(event, Received):
            return self._on_received(event)
        if isinstance(event, CaughtUp):
            return self._on_caught_up(event.now_ms)
        if isinstance(event, Published):
            return self._on_published(event)
        if isinstance(event, PublishFailed):
            return self._on_publish_failed(event)
        return self._on_tick(event.now_ms)

    # -- leadership and recovery ---------------------------------------------------------------

    def _on_leadership(self, event: LeadershipAcquired) -> list[Action]:
        self._reset()
        self.phase = Phase.RECOVERING
        return [Log("info", "became leader; replaying the control log from the last checkpoint")]

    def _step_down(self, reason: str) -> list[Action]:
        if self.phase is Phase.STANDBY:
            return []
        self.phase = Phase.STANDBY
        self.cycle = None
        self.deciding = None
        self.outbox = None
        return [StepDown(reason), Log("warning", f"stepping down: {reason}")]

    def _on_caught_up(self, now: int) -> list[Action]:
        if self.phase is not Phase.RECOVERING:
            return []
        actions: list[Action] = [
            Log(
                "info",
                f"recovered: last txn {self.log.last_txn}, last decided {self.log.last_decided}, "
                f"{len(self.log.pending)} commits awaiting apply",
            )
        ]
        undecided = sorted(self.log.undecided)
        if undecided:
            # Presumed abort: a transaction the previous leader prepared but never decided.
            txn = undecided[-1]
            return actions + self._decide(
                Decision(txn, Outcome.ABORT, reason="presumed abort after coordinator failover"),
                now,
            )
        self.phase = Phase.IDLE
        self.next_cycle_ms = now
        return actions + self._complete_finished()

    # -- messages ------------------------------------------------------------------------------

    def _on_received(self, event: Received) -> list[Action]:
        msg = event.env.payload
        if self.phase is Phase.RECOVERING:
            if self.log.apply(event.env):
                return []
            # Folded in, it would move the transaction counter past numbers never prepared.
            # (Live, the leader folds only its own decisions, on Published: nothing to refuse.)
            return [
                Skipped(
                    "out_of_sequence",
                    self.log.why_out_of_sequence(event.env),
                    getattr(msg, "txn", 0),
                )
            ]
        if isinstance(msg, Vote):
            return self._on_vote(msg, event.now_ms)
        if isinstance(msg, Applied):
            self.log.apply(event.env)
            return self._complete_finished()
        if isinstance(msg, Drained):
            earlier = self.drained.get(msg.participant)
            if earlier is None or msg.after_txn >= earlier.after_txn:
                self.drained[msg.participant] = msg
            return self._on_tick(event.now_ms) if self.phase is Phase.IDLE else []
        # Our own PREPARE/DECISION/COMPLETE/CHECKPOINT come back; they were applied on Published.
        return []

    def _on_vote(self, vote: Vote, now: int) -> list[Action]:
        cycle = self.cycle
        if self.phase is not Phase.COLLECTING or cycle is None or vote.txn != cycle.txn:
            return []  # late or early: the cycle it belongs to is decided already
        earlier = cycle.votes.get(vote.participant)
        if earlier is not None:
            if earlier == vote:
                return []  # a duplicate delivery
            if _supersedes(vote, earlier):
                cycle.votes[vote.participant] = vote
                return self._evaluate(cycle, now)
            return self._abort(
                f"participant {vote.participant} voted twice differently "
                f"(generation {earlier.generation} then {vote.generation})",
                now,
            )
        cycle.votes[vote.participant] = vote
        if vote.vote is VoteValue.ABORT:
            return self._abort(f"participant {vote.participant} voted abort: {vote.reason}", now)
        return self._evaluate(cycle, now)

    def _evaluate(self, cycle: Cycle, now: int) -> list[Action]:
        busy = [v for v in cycle.votes.values() if v.partitions]
        generations = {v.generation for v in busy}
        if len(generations) > 1:
            return self._abort(
                f"votes from generations {sorted(generations)}: a rebalance happened mid-cycle",
                now,
            )
        covered: dict[TP, Vote] = {}
        for vote in busy:
            for pr in vote.partitions:
                tp = (pr.topic, pr.partition)
                other = covered.get(tp)
                if other is not None:
                    return self._abort(
                        f"{pr.topic}[{pr.partition}] claimed by {other.participant} and "
                        f"{vote.participant}",
                        now,
                    )
                covered[tp] = vote
                committed = self._committed_position(tp)
                if committed is not None and pr.start != committed:
                    return self._abort(
                        f"{pr.topic}[{pr.partition}] from {vote.participant} starts at "
                        f"{pr.start} but the committed position is {committed}",
                        now,
                    )
                if pr.end < pr.start:
                    return self._abort(f"{pr.topic}[{pr.partition}] ends before it starts", now)
        # Partitions the metadata does not show yet (a new topic, added partitions) are waited
        # for until the deadline: the next metadata refresh may bring them.
        required = self._required(busy)
        if not required or set(covered) != required:
            return []  # keep waiting for the rest, until the deadline
        parts = tuple(
            Part(v.participant, v.generation, v.sinks)
            for v in sorted(cycle.votes.values(), key=lambda v: v.participant)
            if v.vote is VoteValue.PREPARED
        )
        positions = dict(self.log.positions)
        for tp, vote in covered.items():
            pr = next(p for p in vote.partitions if (p.topic, p.partition) == tp)
            positions[tp] = pr.end
        decision = Decision(
            cycle.txn,
            Outcome.COMMIT,
            parts=parts,
            positions=tuple(Position(t, p, o) for (t, p), o in sorted(positions.items())),
        )
        return self._decide(decision, now)

    def _required(self, busy: list[Vote]) -> frozenset[TP]:
        """The partitions the votes must cover: every source partition of a topic some
        non-empty vote subscribed to (a vote without ``topics``: of every topic). A topic no
        voter reads yet -- a new one a pattern matches, which the participants pick up after the
        coordinator -- waits for them; its positions stay where they are."""
        if any(v.topics is None for v in busy):
            return self.partitions
        topics = {t for v in busy for t in v.topics or ()}
        return frozenset(tp for tp in self.partitions if tp[0] in topics)

    def _committed_position(self, tp: TP) -> int | None:
        if tp in self.log.positions:
            return self.log.positions[tp]
        return self.group_offsets.get(tp)

    def committed_positions(self) -> dict[TP, int]:
        """Every known committed position: the decision log's, else the group's offset."""
        return {**self.group_offsets, **self.log.positions}

    # -- decisions -----------------------------------------------------------------------------

    def _abort(self, reason: str, now: int) -> list[Action]:
        assert self.cycle is not None
        return self._decide(Decision(self.cycle.txn, Outcome.ABORT, reason=reason), now)

    def _decide(self, decision: Decision, now: int) -> list[Action]:
        self.phase = Phase.DECIDING
        self.deciding = decision
        self.outbox = decision
        return [Publish(decision)]

    def _on_published(self, event: Published) -> list[Action]:
        msg = event.payload
        now = event.now_ms
        if self.outbox is msg:
            self.outbox = None
        if isinstance(msg, Prepare):
            if self.cycle is not None and self.cycle.txn == msg.txn:
                self.cycle.prepare_landed = True
            # Hints sent before this PREPARE speak of records it has just cut.
            self.drained = {p: h for p, h in self.drained.items() if h.after_txn >= msg.txn}
            self.log.last_txn = max(self.log.last_txn, msg.txn)
            self.log.undecided.add(msg.txn)
            return []
        if isinstance(msg, Decision):
            return self._on_decided(msg, now)
        if isinstance(msg, Checkpoint):
            self.decisions_since_checkpoint = 0
        if isinstance(msg, Complete):
            self.log.pending.pop(msg.txn, None)
        return []

    def _on_decided(self, d: Decision, now: int) -> list[Action]:
        self.log.apply_decision(d)
        self.deciding = None
        started = self.cycle.started_ms if self.cycle and self.cycle.txn == d.txn else now
        self.cycle = None
        self.phase = Phase.IDLE
        self.last_cycle_ms = now - started
        # The next cycle starts one interval after this one started, or now if we are late.
        self.next_cycle_ms = max(now, started + self.settings.commit_interval_ms)
        self.decisions_since_checkpoint += 1
        actions: list[Action] = []
        if d.outcome is Outcome.COMMIT:
            self.committed += 1
            self.last_commit_ms = now
            self.failed_cycles = 0
            actions.append(Log("info", f"committed ({len(d.parts)} parts)", d.txn))
            if self.alarm:
                self.alarm = False
                actions.append(Alarm(False, 0, "a cycle committed again"))
        else:
            self.aborted += 1
            self.failed_cycles += 1
            actions.append(Log("warning", f"aborted: {d.reason}", d.txn))
            if self.failed_cycles >= self.settings.max_failed_cycles:
                self.alarm = True
                actions.append(
                    Alarm(
                        True,
                        self.failed_cycles,
                        f"{self.failed_cycles} consecutive commit cycles failed; last: {d.reason}",
                    )
                )
        actions += self._complete_finished()
        if self.decisions_since_checkpoint >= self.settings.checkpoint_every:
            actions.append(self._publish(self.log.checkpoint()))
        return actions

    def _complete_finished(self) -> list[Action]:
        return [
            self._publish(Complete(txn))
            for txn, p in sorted(self.log.pending.items())
            if p.complete
        ]

    def _publish(self, payload: Payload) -> Publish:
        return Publish(payload)

    def _on_publish_failed(self, event: PublishFailed) -> list[Action]:
        if event.fenced:
            return self._step_down(f"fenced by a newer coordinator: {event.reason}")
        msg = event.payload
        actions: list[Action] = [Log("warning", f"publish failed, will retry: {event.reason}")]
        if isinstance(msg, Prepare):
            # It may or may not have landed; deciding abort is right either way.
            return actions + self._decide(
                Decision(msg.txn, Outcome.ABORT, reason=f"prepare not written: {event.reason}"),
                event.now_ms,
            )
        if isinstance(msg, Decision):
            # Re-publish the same decision: a decision never changes its mind.
            self.outbox = msg
            self.retry_at_ms = event.now_ms + self.settings.publish_retry_ms
        # COMPLETE and CHECKPOINT are re-derived later; nothing to retry.
        return actions

    # -- time ----------------------------------------------------------------------------------

    def _on_tick(self, now: int) -> list[Action]:
        if self.phase is Phase.DECIDING:
            if self.outbox is not None and now >= self.retry_at_ms:
                self.retry_at_ms = now + self.settings.publish_retry_ms
                return [Publish(self.outbox)]
            return []
        if self.phase is Phase.COLLECTING and self.cycle is not None:
            if self.recheck and now < self.cycle.deadline_ms:
                self.recheck = False
                return self._evaluate(self.cycle, now)
            if now >= self.cycle.deadline_ms:
                votes = self.cycle.votes.values()
                claimed = {(p.topic, p.partition) for v in votes for p in v.partitions}
                missing = self._required([v for v in votes if v.partitions]) - claimed
                unknown = claimed - self.partitions
                why = f"no vote covered {_fmt(missing)}" if missing or not unknown else ""
                if unknown:
                    why += "; " if why else ""
                    why += f"votes name partitions the metadata does not show: {_fmt(unknown)}"
                return self._abort(
                    f"vote timeout after {self.settings.vote_timeout_ms} ms: {why}; "
                    f"voters: {sorted(self.cycle.votes) or 'none'}",
                    now,
                )
            return []
        if self.phase is Phase.IDLE and self.partitions:
            if now < self.next_cycle_ms:
                if not self._drained():
                    return []
                self.early_cycles += 1
            txn = max(self.log.last_txn, self.log.last_decided) + 1
            self.cycle = Cycle(txn, now, now + self.settings.vote_timeout_ms)
            self.phase = Phase.COLLECTING
            return [Publish(Prepare(txn, self.cycle.deadline_ms))]
        return []

    def _drained(self) -> bool:
        """Whether the participants' DRAINED hints since the last PREPARE cover every source
        partition and hold enough records to start a cycle before the interval. Never after a
        failed cycle: whatever failed it keeps the interval's pace until a cycle commits."""
        if not self.settings.early_min_records or self.failed_cycles:
            return False
        last = max(self.log.last_txn, self.log.last_decided)
        hints = [h for h in self.drained.values() if h.after_txn == last]
        if sum(h.records for h in hints) < self.settings.early_min_records:
            return False
        covered = {(p.topic, p.partition) for h in hints for p in h.positions}
        return self.partitions <= covered


def _supersedes(vote: Vote, earlier: Vote) -> bool:
    """A participant that voted idle (no partitions, nothing prepared) before it was assigned
    any may vote again from a later generation: its first vote covered and promised nothing."""
    return (
        earlier.vote is VoteValue.PREPARED
        and not earlier.partitions
        and not earlier.sinks
        and vote.vote is VoteValue.PREPARED
        and vote.generation > earlier.generation
    )


def _fmt(tps: set[TP] | frozenset[TP]) -> str:
    if not tps:
        return "-"
    return ", ".join(f"{t}[{p}]" for t, p in sorted(tps))
