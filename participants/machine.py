"""A participant's decisions as a pure state machine: events in, actions out, no I/O.

The runtime (:mod:`twophase.participants.runtime`) has two threads and feeds both into this one machine
under a lock: the *data* thread (source consumer, sink writes, prepares) and the *control* thread
(control-topic reader, decision apply). Each action says which thread must run it.

The part being filled is *open*; PREPARE(T) *cuts* it: the data thread freezes it as T, prepares
it in every sink, and the vote goes out. Records then flow into the next part at once; they start
at T's end positions, which are only right if T commits -- so any decision that leaves the
committed positions different from where the open part starts makes the machine *rewind*: abort
the open part and seek back to the committed positions.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from twophase.protocol.logview import LogView
from twophase.protocol.messages import (
    Applied,
    Decision,
    Drained,
    Envelope,
    Outcome,
    PartitionRange,
    Position,
    Prepare,
    Vote,
    VoteValue,
)

__all__ = [
    "AbortPart",
    "Action",
    "Assigned",
    "BeginPart",
    "CaughtUp",
    "CommitPart",
    "Cut",
    "Event",
    "InDoubt",
    "Log",
    "PartApplied",
    "ParticipantMachine",
    "PrepareDone",
    "PrepareFailed",
    "PreparePart",
    "Quiet",
    "Received",
    "Revoked",
    "Seek",
    "SendApplied",
    "SendDrained",
    "Skipped",
    "SendVote",
    "Sweep",
    "Tick",
    "WillWrite",
    "Written",
]

TP = tuple[str, int]


class Thread(enum.Enum):
    DATA = "data"
    CONTROL = "control"


# -- events ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Received:
    """A control message. ``replay`` while folding the log tail at start-up."""

    env: Envelope
    replay: bool = False


@dataclass(frozen=True, slots=True)
class CaughtUp:
    """The start-up replay reached the end of the control topic."""


@dataclass(frozen=True, slots=True)
class InDoubt:
    """Prepared parts found in the sinks: ``(sink, txn, participant)``. ``sweep`` marks the
    periodic look, which also finishes dead participants' parts."""

    parts: tuple[tuple[str, int, str], ...]
    sweep: bool = False
    #: Participants that are live members of the source group right now (their own parts are
    #: theirs to finish); None when membership could not be read -- then no foreign part is
    #: touched this sweep.
    live: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class Assigned:
    """A new assignment. ``offsets`` are the group's committed offsets (or the log start) -- used
    only for partitions the decision log has never named."""

    generation: int
    member_id: str
    offsets: Mapping[TP, int]
    #: The source topics the consumer subscribed to for this assignment (its votes carry them:
    #: the coordinator's coverage rule); None: every source topic.
    topics: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class Revoked:
    pass


@dataclass(frozen=True, slots=True)
class WillWrite:
    """The data thread has records to write: it needs an open part."""


@dataclass(frozen=True, slots=True)
class Written:
    """The data thread wrote a batch into open part ``txn``: per partition ``(last offset,
    records written, records dead-lettered)``."""

    txn: int
    batch: Mapping[TP, tuple[int, int, int]]


@dataclass(frozen=True, slots=True)
class Cut:
    """The data thread is ready to prepare ``txn`` (it asked via :class:`PreparePart`)."""

    txn: int


@dataclass(frozen=True, slots=True)
class PrepareDone:
    txn: int


@dataclass(frozen=True, slots=True)
class PrepareFailed:
    txn: int
    reason: str


@dataclass(frozen=True, slots=True)
class PartApplied:
    """Every sink applied the decision for ``participant``'s part of ``txn``."""

    txn: int
    participant: str
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class Tick:
    now_ms: int


@dataclass(frozen=True, slots=True)
class Quiet:
    """The data thread has read everything its partitions hold and no record has come for
    ``commit.early_idle_ms``: ``positions`` are the next offsets it reads."""

    positions: Mapping[TP, int]


Event = (
    Received
    | CaughtUp
    | InDoubt
    | Assigned
    | Revoked
    | WillWrite
    | Written
    | Cut
    | PrepareDone
    | PrepareFailed
    | PartApplied
    | Tick
    | Quiet
)

# -- actions -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BeginPart:
    txn: int
    thread: Thread = Thread.DATA


@dataclass(frozen=True, slots=True)
class PreparePart:
    """Cut the open part as ``txn``: the data thread answers with :class:`Cut`, then prepares
    with the positions the machine returns from it."""

    txn: int
    positions: Mapping[TP, int] = field(default_factory=dict)
    sinks: tuple[str, ...] = ()
    ready: bool = False  # False: please Cut; True: prepare now with these positions
    thread: Thread = Thread.DATA


@dataclass(frozen=True, slots=True)
class CommitPart:
    txn: int
    participant: str
    sinks: tuple[str, ...]
    thread: Thread = Thread.CONTROL


@dataclass(frozen=True, slots=True)
class AbortPart:
    txn: int
    participant: str
    sinks: tuple[str, ...]
    thread: Thread = Thread.CONTROL


@dataclass(frozen=True, slots=True)
class Seek:
    """Drop anything fetched and not yet written; continue from these offsets."""

    offsets: Mapping[TP, int]
    thread: Thread = Thread.DATA


@dataclass(frozen=True, slots=True)
class SendVote:
    vote: Vote
    thread: Thread = Thread.CONTROL


@dataclass(frozen=True, slots=True)
class SendApplied:
    applied: Applied
    thread: Thread = Thread.CONTROL


@dataclass(frozen=True, slots=True)
class SendDrained:
    """Tell the coordinator this participant's input is drained (advisory; best effort, on the
    data thread, which is idle then)."""

    drained: Drained
    thread: Thread = Thread.DATA


@dataclass(frozen=True, slots=True)
class Sweep:
    """List the sinks' in-doubt parts and report them with ``InDoubt(sweep=True)``; then, when
    ``forget_before`` is set, have every sink forget decided parts' markers below it
    (:meth:`ParticipantMachine.forget_before`)."""

    forget_before: int = 0
    thread: Thread = Thread.CONTROL


@dataclass(frozen=True, slots=True)
class Log:
    level: str
    message: str
    txn: int = 0


@dataclass(frozen=True, slots=True)
class Skipped:
    """A control message read but not acted on, because it cannot follow from the log (``kind``
    ``out_of_sequence``): counted with the skips the reader makes and logged."""

    kind: str
    message: str
    txn: int = 0
    thread: Thread = Thread.CONTROL


Action = (
    BeginPart
    | PreparePart
    | CommitPart
    | AbortPart
    | Seek
    | SendVote
    | SendApplied
    | SendDrained
    | Sweep
    | Log
    | Skipped
)


@dataclass(slots=True)
class OpenPart:
    txn: int
    start: dict[TP, int]
    end: dict[TP, int] = field(default_factory=dict)
    records: dict[TP, int] = field(default_factory=dict)
    dead: dict[TP, int] = field(default_factory=dict)
    begun: bool = False
    cut: bool = False


@dataclass(slots=True)
class PreparedPart:
    txn: int
    start: dict[TP, int]
    end: dict[TP, int]
    sinks: tuple[str, ...]
    voted: bool = False


@dataclass(frozen=True, slots=True)
class ParticipantSettings:
    participant: str
    sinks: tuple[str, ...]
    #: How often the sinks are swept for in-doubt parts left by dead participants.
    sweep_interval_ms: int = 15_000
    #: Decided transactions below the last decided one whose markers the sinks keep, for
    #: operators (``twophase txn show``); older ones are forgotten on the sweep.
    keep_decided_txns: int = 1000


class ParticipantMachine:
    def __init__(self, settings: ParticipantSettings) -> None:
        self.settings = settings
        self.me = settings.participant
        self.log = LogView(prepare_in_sequence=True)
        self.caught_up = False
        #: The start-up in-doubt listing is folded in: until then this machine cannot tell a
        #: part of its own earlier incarnation from none, so it votes nothing, and is not
        #: ``ready`` (a runtime writes only while it is).
        self.listed = False
        self.generation = -1
        self.member_id = ""
        self.topics: tuple[str, ...] | None = None
        self.assigned = False
        #: Where the next part starts, per assigned partition.
        self.base: dict[TP, int] = {}
        #: The group's offsets from the assignment: the committed position of a partition the
        #: decision log has never named.
        self.fallback: dict[TP, int] = {}
        self.open: OpenPart | None = None
        self.prepared: dict[int, PreparedPart] = {}
        #: Parts found prepared in the sinks (earlier incarnations, other participants):
        #: (txn, participant) -> sinks holding it.
        self.in_doubt: dict[tuple[int, str], set[str]] = {}
        #: Foreign in-doubt parts seen by the previous sweep: finished only when seen twice, so a
        #: live owner applying its own decision is not raced.
        self.seen_last_sweep: set[tuple[int, str]] = set()
        #: Parts whose decision is being applied, and the sinks it is applied in.
        self.applying: dict[tuple[int, str], tuple[str, ...]] = {}
        self.pending_prepare: int = 0
        #: A PREPARE still undecided when the start-up replay ended: sent before this process
        #: could hear it. Voted on (with an empty part) at the first assignment, instead of
        #: leaving the coordinator to wait out its vote timeout.
        self.inflight_at_start: int = 0
        #: The last transaction cut: PREPAREs only grow, so one at or below it is a re-read.
        self.last_cut: int = 0
        self.next_sweep_ms = 0
        #: The transaction after which this participant last said its input is drained, the
        #: records it held then, and the latest transaction after which a peer said so holding
        #: records.
        self.drained_after = -1
        self.drained_records = 0
        self.peer_drained_after = -1
        # Figures for status and metrics only.
        self.votes_sent = 0
        self.rewinds = 0

    # -- queries -------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.caught_up and self.listed and self.assigned

    def next_txn(self) -> int:
        return max(self.log.last_txn, self.log.last_decided) + 1

    def forget_before(self) -> int:
        """The transaction below which the sinks may forget decided parts' markers; 0: none.

        A sink that forgot a part no longer knows it: a ``commit`` of it raises
        UnknownPartError. So the bound is at most
        * the oldest pending commit (committed, not yet acknowledged by all its parts): the
          start-up replay and the sweep re-apply exactly those. Every reader's view keeps a
          commit pending until the coordinator has seen every part applied (COMPLETE, or a
          checkpoint without it), so a view that lags only holds the bound further back;
        * ``keep_decided_txns`` below the last decided transaction: ``twophase txn show`` of
          recent transactions, and slack for a reader whose view lags behind this one's.
        Parts not decided yet are safe whatever the bound: sinks forget decided parts only
        (and an abort of a forgotten part is a no-op). Nothing until caught up: before the log
        tail is folded, ``pending`` is incomplete.
        """
        if not self.caught_up:
            return 0
        bound = self.log.last_decided + 1 - self.settings.keep_decided_txns
        if self.log.pending:
            bound = min(bound, min(self.log.pending))
        return bound if bound > 1 else 0  # transactions start at 1: below 1 there is nothing

    # -- the one entry point -------------------------------------------------------------------

    def handle(self, event: Event) -> list[Action]:
        if isinstance(event, Received):
            return self._on_received(event)
        if isinstance(event, CaughtUp):
            self.caught_up = True
            undecided = [t for t in self.log.undecided if t > self.log.last_decided]
            if undecided:
                self.inflight_at_start = max(undecided)
            return [Log("info", f"caught up: last decided txn {self.log.last_decided}")]
        if isinstance(event, InDoubt):
            return self._on_in_doubt(event)
        if isinstance(event, Assigned):
            return self._on_assigned(event)
        if isinstance(event, Revoked):
            return self._on_revoked()
        if isinstance(event, WillWrite):
            return self._on_will_write()
        if isinstance(event, Written):
            return self._on_written(event)
        if isinstance(event, Cut):
            return self._on_cut(event.txn)
        if isinstance(event, PrepareDone):
            return self._on_prepared(event.txn)
        if isinstance(event, PrepareFailed):
            return self._on_prepare_failed(event)
        if isinstance(event, PartApplied):
            return self._on_applied(event)
        if isinstance(event, Quiet):
            return self._on_quiet(event)
        return self._on_tick(event.now_ms)

    # -- control messages ----------------------------------------------------------------------

    def _on_received(self, event: Received) -> list[Action]:
        msg = event.env.payload
        if not self.log.apply(event.env):
            return [
                Skipped(
                    "out_of_sequence",
                    self.log.why_out_of_sequence(event.env),
                    getattr(msg, "txn", 0),
                )
            ]
        if isinstance(msg, Drained):
            if msg.participant != self.me and msg.records:
                self.peer_drained_after = max(self.peer_drained_after, msg.after_txn)
            return []
        if event.replay or not self.caught_up:
            return []
        if isinstance(msg, Prepare):
            return self._on_prepare(msg)
        if isinstance(msg, Decision):
            return self._on_decision(msg)
        return []

    def _on_prepare(self, msg: Prepare) -> list[Action]:
        if msg.txn <= self.log.last_decided:
            # Decided already: a redelivery, or a stray PREPARE. Nothing to vote on; said out
            # loud, never silently (a participant that ignores every PREPARE must show why).
            return [
                Log(
                    "warning",
                    f"PREPARE ignored: every transaction up to {self.log.last_decided} is decided",
                    msg.txn,
                )
            ]
        if msg.txn == self.pending_prepare or msg.txn == self.last_cut:
            # A re-read. Cutting again would replace the part we voted on, or (after a failed
            # prepare) begin a part under the same id the control thread may still abort.
            return [Log("info", "PREPARE read again: already cut, not cut twice", msg.txn)]
        if msg.txn < self.last_cut:
            return [
                Log(
                    "warning",
                    f"PREPARE ignored: transaction {self.last_cut} is cut already",
                    msg.txn,
                )
            ]
        self.pending_prepare = msg.txn
        part = self.open
        if part is not None and part.begun and part.txn != msg.txn:
            # Built for a transaction that will never be prepared: start over from committed state.
            actions = self._rewind(f"open part {part.txn} does not match PREPARE {msg.txn}")
            return actions + [PreparePart(msg.txn)]
        if part is not None:
            part.txn = msg.txn
        return [PreparePart(msg.txn)]

    def _on_decision(self, d: Decision) -> list[Action]:
        actions: list[Action] = []
        if self.pending_prepare and self.pending_prepare <= d.txn:
            self.pending_prepare = 0  # decided before we voted: nothing left to prepare for it
        mine = self.prepared.pop(d.txn, None)
        if mine is not None:
            outcome = self.log.outcome_of(d.txn, self.me)
            if outcome is Outcome.COMMIT:
                actions.append(self._apply(d.txn, self.me, mine.sinks, Outcome.COMMIT))
            else:
                actions.append(self._apply(d.txn, self.me, mine.sinks, Outcome.ABORT))
                actions.append(
                    Log("warning", f"own part aborted: {d.reason or 'not included'}", d.txn)
                )
        actions += self._resolve_known()
        # Any prepared part older than this decision was decided too (presumed abort otherwise).
        for txn in [t for t in self.prepared if t < d.txn]:
            stale = self.prepared.pop(txn)
            actions.append(self._apply(txn, self.me, stale.sinks, Outcome.ABORT))
        if self.open is not None and self.open.txn <= d.txn and not self.open.cut:
            self.open.txn = d.txn + 1 if not self.open.begun else self.open.txn
        actions += self._check_chain(d)
        return actions

    def _check_chain(self, d: Decision) -> list[Action]:
        """Rewind when the open part does not start at the committed positions."""
        if any(p for p in self.prepared.values()):
            return []  # our own undecided part sits between committed state and the open part
        committed = {tp: self._committed(tp) for tp in self.base}
        wrong = {
            tp: (self.base[tp], committed[tp])
            for tp in self.base
            if committed[tp] is not None and committed[tp] != self.base[tp]
        }
        stale_open = self.open is not None and self.open.begun and self.open.txn <= d.txn
        if not wrong and not stale_open:
            return []
        detail = ", ".join(f"{t}[{p}] {a}->{b}" for (t, p), (a, b) in sorted(wrong.items()))
        return self._rewind(f"after decision {d.txn} ({d.outcome.value}): {detail or 'stale part'}")

    def _rewind(self, why: str) -> list[Action]:
        actions: list[Action] = []
        part = self.open
        if part is not None and part.begun:
            actions.append(AbortPart(part.txn, self.me, self.settings.sinks, thread=Thread.DATA))
        self.open = None
        for tp in self.base:
            self.base[tp] = self._start_of(tp)
        self.rewinds += 1
        actions.append(Seek(dict(self.base)))
        actions.append(Log("warning", f"rewinding to committed positions: {why}"))
        return actions

    def _start_of(self, tp: TP) -> int:
        """Where a new part starts in ``tp``: after our own undecided prepared part, else the
        committed position."""
        ends = [p.end[tp] for _, p in sorted(self.prepared.items()) if tp in p.end]
        if ends:
            return ends[-1]
        committed = self._committed(tp)
        return self.base.get(tp, 0) if committed is None else committed

    def _committed(self, tp: TP) -> int | None:
        """The committed position: from the decision log, else the group's offset."""
        if tp in self.log.positions:
            return self.log.positions[tp]
        return self.fallback.get(tp)

    # -- assignment ----------------------------------------------------------------------------

    def _on_assigned(self, event: Assigned) -> list[Action]:
        actions: list[Action] = []
        if self.open is not None and self.open.begun:
            actions.append(
                AbortPart(self.open.txn, self.me, self.settings.sinks, thread=Thread.DATA)
            )
        self.open = None
        self.generation = event.generation
        self.member_id = event.member_id
        self.topics = event.topics
        self.assigned = True
        self.drained_after = -1  # a new set of partitions: worth saying again
        self.fallback = dict(event.offsets)
        self.base = {tp: self._start_of(tp) for tp in event.offsets}
        actions.append(Seek(dict(self.base)))
        actions.append(
            Log("info", f"assigned {len(self.base)} partitions in generation {self.generation}")
        )
        actions += self._revote_idle()
        return actions + self._vote_inflight()

    def _vote_inflight(self) -> list[Action]:
        """Vote an empty part, from the committed positions, on the PREPARE still open when the
        start-up replay ended -- on an assignment that comes after the start-up in-doubt
        listing. Before the listing an earlier incarnation's part of that transaction may sit
        prepared in a sink: an empty vote committed beside it would let a later sweep commit
        that part too, whose records no position covers (simulator seed 9841).

        An assignment that came before the listing leaves the vote to the next assignment, or
        to the coordinator's vote timeout. Voting when the listing comes would hand the cut to
        a data thread that may write into the part first; and records voted on a transaction
        an earlier incarnation already voted on can be committed under that incarnation's
        vote, which names none of them (seed 25043)."""
        if not (self.listed and self.inflight_at_start):
            return []
        inflight, self.inflight_at_start = self.inflight_at_start, 0
        if (
            inflight > self.log.last_decided
            and not self.pending_prepare
            and inflight > self.last_cut
            and (inflight, self.me) not in self.in_doubt
        ):
            # Nothing written yet (the assignment just dropped any open part): the part is
            # empty, from the committed positions.
            self.pending_prepare = inflight
            return self._on_cut(inflight)
        return []

    def _revote_idle(self) -> list[Action]:
        """An idle vote (no partitions: cast before this process held any) on a transaction
        still undecided covers nothing, and the partitions just assigned would stay uncovered
        until the vote timeout. Vote again, in the new generation, with an empty part from the
        committed positions: the coordinator lets a later generation's vote replace an idle
        one, so the cycle commits or fails on its generations at once."""
        actions: list[Action] = []
        for txn, part in sorted(self.prepared.items()):
            if part.start or part.sinks or txn <= self.log.last_decided or not self.base:
                continue
            part.start = dict(self.base)
            part.end = dict(self.base)
            ranges = tuple(
                PartitionRange(t, p, o, o, 0, 0) for (t, p), o in sorted(self.base.items())
            )
            actions.append(self._prepared_vote(txn, ranges, ()))
            actions.append(Log("info", "re-voted an idle vote in the new generation", txn))
        return actions

    def _on_revoked(self) -> list[Action]:
        actions: list[Action] = []
        if self.open is not None and self.open.begun:
            # Open work for revoked partitions is abandoned and never voted.
            actions.append(
                AbortPart(self.open.txn, self.me, self.settings.sinks, thread=Thread.DATA)
            )
            actions.append(Log("info", "partitions revoked: open part abandoned", self.open.txn))
        self.open = None
        self.base = {}
        self.assigned = False
        return actions

    # -- the data path -------------------------------------------------------------------------

    def _ensure_open(self) -> OpenPart:
        if self.open is None:
            self.open = OpenPart(self.next_txn(), start=dict(self.base))
        return self.open

    def _on_will_write(self) -> list[Action]:
        part = self._ensure_open()
        if part.begun:
            return []
        # A PREPARE we have not cut yet will cut this very part: number it so, or the cut
        # would prepare a transaction the sinks never began.
        part.txn = self.pending_prepare or max(part.txn, self.next_txn())
        part.begun = True
        return [BeginPart(part.txn)]

    def _on_written(self, event: Written) -> list[Action]:
        part = self.open
        if part is None or part.txn != event.txn or not part.begun or part.cut:
            return []  # written into a part since abandoned; it was aborted and will be re-read
        for tp, (last, n, dead) in event.batch.items():
            if tp not in part.start:
                continue
            part.end[tp] = last + 1
            part.records[tp] = part.records.get(tp, 0) + n
            part.dead[tp] = part.dead.get(tp, 0) + dead
        return []

    def _on_cut(self, txn: int) -> list[Action]:
        if txn != self.pending_prepare:
            return []  # decided or superseded meanwhile
        part = self._ensure_open()
        part.txn = txn
        part.cut = True
        self.last_cut = txn
        ends = {tp: part.end.get(tp, start) for tp, start in part.start.items()}
        sinks = self.settings.sinks if part.begun else ()
        return [PreparePart(txn, positions=ends, sinks=sinks, ready=True)]

    def _on_prepared(self, txn: int) -> list[Action]:
        part = self.open
        if part is None or part.txn != txn or not part.cut:
            return []
        self.open = None
        self.pending_prepare = 0
        end = {tp: part.end.get(tp, start) for tp, start in part.start.items()}
        sinks = self.settings.sinks if part.begun else ()
        self.prepared[txn] = PreparedPart(txn, dict(part.start), end, sinks, voted=True)
        self.base = dict(end)
        ranges = tuple(
            PartitionRange(
                t,
                p,
                part.start[(t, p)],
                end[(t, p)],
                part.records.get((t, p), 0),
                part.dead.get((t, p), 0),
            )
            for t, p in sorted(part.start)
        )
        return [self._prepared_vote(txn, ranges, sinks)]

    def _prepared_vote(
        self, txn: int, ranges: tuple[PartitionRange, ...], sinks: tuple[str, ...]
    ) -> SendVote:
        self.votes_sent += 1
        return SendVote(
            Vote(
                txn=txn,
                participant=self.me,
                generation=self.generation,
                member_id=self.member_id,
                vote=VoteValue.PREPARED,
                partitions=ranges,
                sinks=sinks,
                topics=self.topics,
            )
        )

    def _on_prepare_failed(self, event: PrepareFailed) -> list[Action]:
        part = self.open
        actions: list[Action] = [
            SendVote(
                Vote(
                    txn=event.txn,
                    participant=self.me,
                    generation=self.generation,
                    member_id=self.member_id,
                    vote=VoteValue.ABORT,
                    reason=event.reason,
                )
            )
        ]
        self.pending_prepare = 0
        if part is not None:
            part.cut = False
        return actions + self._rewind(f"prepare of {event.txn} failed: {event.reason}")

    # -- applying decisions --------------------------------------------------------------------

    def _apply(
        self, txn: int, participant: str, sinks: tuple[str, ...], outcome: Outcome
    ) -> Action:
        self.applying[(txn, participant)] = sinks
        if outcome is Outcome.COMMIT:
            return CommitPart(txn, participant, sinks)
        return AbortPart(txn, participant, sinks)

    def _on_applied(self, event: PartApplied) -> list[Action]:
        key = (event.txn, event.participant)
        done = self.applying.pop(key, ())
        self.in_doubt.pop(key, None)
        if event.outcome is not Outcome.COMMIT:
            return []
        declared = self.log.declared_sinks(event.txn, event.participant)
        if declared is not None and not set(declared) <= set(done):
            # APPLIED means every sink of the part; the rest are not ours to commit.
            missing = sorted(set(declared) - set(done))
            return [
                Log("warning", f"{event.participant}'s part is not ours in {missing}", event.txn)
            ]
        return [SendApplied(Applied(event.txn, event.participant, self.me))]

    def _on_in_doubt(self, event: InDoubt) -> list[Action]:
        found: dict[tuple[int, str], set[str]] = {}
        for sink, txn, participant in event.parts:
            found.setdefault((txn, participant), set()).add(sink)
        # Committed parts nobody acknowledged (the owner crashed between apply and APPLIED, or is
        # gone): re-applying is idempotent, and the acknowledgement lets the coordinator complete.
        for txn, pending in self.log.pending.items():
            for name in pending.parts:
                if name not in pending.acked and (event.sweep or name == self.me):
                    found.setdefault((txn, name), set())  # the sinks come from the decision
        seen_now: set[tuple[int, str]] = set()
        for key, sinks in sorted(found.items()):
            txn, participant = key
            if key in self.applying or (participant == self.me and txn in self.prepared):
                continue  # this incarnation's own work, handled on its decision
            foreign = participant != self.me
            if event.sweep and foreign and (event.live is None or participant in event.live):
                continue  # a live owner finishes its own parts; racing it only costs conflicts
            if event.sweep and foreign and key not in self.seen_last_sweep:
                seen_now.add(key)  # finish a foreign part only once it has sat for a whole sweep
                continue
            self.in_doubt.setdefault(key, set()).update(sinks)
        if event.sweep:
            self.seen_last_sweep = seen_now
        else:
            self.listed = True
        return self._resolve_known()

    def _resolve_known(self) -> list[Action]:
        actions: list[Action] = []
        for key, sinks in sorted(self.in_doubt.items()):
            if key in self.applying:
                continue
            txn, participant = key
            outcome = self.log.outcome_of(txn, participant)
            if outcome is Outcome.COMMIT:
                # A listing may be older than the prepare it caught half-way; the vote named
                # every sink the part was prepared in before anyone could commit it.
                declared = self.log.declared_sinks(txn, participant) or ()
                sinks = sinks | (set(declared) & set(self.settings.sinks))
            if outcome is not None:
                actions.append(self._apply(txn, participant, tuple(sorted(sinks)), outcome))
                actions.append(
                    Log("info", f"resolving in-doubt part of {participant}: {outcome.value}", txn)
                )
        return actions

    def _on_quiet(self, event: Quiet) -> list[Action]:
        """Say DRAINED when the open part holds records -- or holds none but a peer said it
        holds some: the coordinator needs every partition covered, and an idle pipeline then
        sends nothing at all. Once per transaction, and again only when the part has more than
        doubled since (a pause inside a burst, then the rest of it; a reply with nothing, then
        records of its own): a few messages per cycle at most. Never between a PREPARE and its
        vote: the records in hand belong to the transaction being cut."""
        after = max(self.log.last_txn, self.log.last_decided)
        if not self.ready or self.pending_prepare or not self.base:
            return []
        part = self.open
        held = 0
        if part is not None and part.begun and not part.cut:
            held = sum(part.records.values()) + sum(part.dead.values())
        if self.drained_after == after and held <= 2 * self.drained_records:
            return []
        if not held and self.peer_drained_after != after:
            return []
        self.drained_after = after
        self.drained_records = held
        positions = tuple(
            Position(t, p, event.positions.get((t, p), self.base[(t, p)]))
            for t, p in sorted(self.base)
        )
        return [SendDrained(Drained(after, self.me, self.generation, positions, held))]

    def _on_tick(self, now: int) -> list[Action]:
        if not self.caught_up or now < self.next_sweep_ms:
            return []
        self.next_sweep_ms = now + self.settings.sweep_interval_ms
        return [Sweep(forget_before=self.forget_before())]
