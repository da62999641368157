"""What the control log says, folded message by message. Pure: no I/O.

Both the coordinator (recovering after failover) and every participant (resolving in-doubt parts)
read the tail of the control topic from the latest CHECKPOINT and fold it into a :class:`LogView`.
The view answers the one question recovery asks: *what happened to part P of transaction T?*

Invariant the coordinator keeps, and the view relies on: a transaction is decided before the next
one is prepared, so every transaction up to :attr:`LogView.last_decided` is decided, and one that
has no COMMIT decision naming the part was aborted (presumed abort).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

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

__all__ = ["LogView", "Pending"]

TP = tuple[str, int]

#: Decisions remembered beyond the pending ones. Older committed-and-complete transactions need
#: no lookup (nothing of theirs is prepared anywhere), so this only bounds memory.
DECISION_WINDOW = 4096


@dataclass(slots=True)
class Pending:
    """A committed transaction whose parts are not all applied yet."""

    txn: int
    parts: dict[str, Part]
    acked: set[str] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return set(self.parts) <= self.acked

    def to_message(self) -> PendingCommit:
        return PendingCommit(self.txn, tuple(self.parts.values()), tuple(sorted(self.acked)))


@dataclass(slots=True)
class LogView:
    last_txn: int = 0
    last_decided: int = 0
    positions: dict[TP, int] = field(default_factory=dict)
    pending: dict[int, Pending] = field(default_factory=dict)
    undecided: set[int] = field(default_factory=set)
    decisions: OrderedDict[int, Decision] = field(default_factory=OrderedDict)
    #: Refuse a PREPARE past the next transaction number. Not for Spark pipelines, whose
    #: driver numbers transactions by batch id (a direct call may pass any id).
    prepare_in_sequence: bool = False

    def out_of_sequence(self, msg: Payload) -> bool:
        """Whether ``msg`` cannot follow from the log folded so far, so folding it would move
        the view somewhere no writer of this pipeline can have taken it:

        * a DECISION above the last decided transaction that was never prepared (no PREPARE
          read, undecided) and is not the next number either. The next number is legitimate
          without its PREPARE: a coordinator whose PREPARE write failed decides abort for it
          whether or not it landed. Folded in, a jump would make every PREPARE up to it look
          decided already, and participants would ignore them all;
        * a CHECKPOINT (not the first message read) claiming more transactions decided than
          this view has seen: its writer wrote it after the decisions it covers, so a reader
          that started before it has read them all;
        * with ``prepare_in_sequence`` (coordinator pipelines, where one coordinator numbers
          every PREPARE as the next transaction): a PREPARE past the next number.

        A view that has folded nothing yet accepts anything: its first message is where the
        reader starts (a checkpoint, or whatever retention left), not a sequence to check."""
        if self.last_txn == 0 and self.last_decided == 0:
            return False
        following = max(self.last_txn, self.last_decided) + 1
        if isinstance(msg, Decision):
            if msg.txn <= self.last_decided:
                return False  # a replay, ignored by the fold anyway
            return msg.txn not in self.undecided and msg.txn != following
        if isinstance(msg, Checkpoint):
            return msg.last_txn >= following
        if isinstance(msg, Prepare):
            return self.prepare_in_sequence and msg.txn > following
        return False

    def why_out_of_sequence(self, env: Envelope) -> str:
        """The log line for a message :meth:`out_of_sequence` refused."""
        msg = env.payload
        what = f"{type(msg).__name__.upper()} {getattr(msg, 'txn', getattr(msg, 'last_txn', 0))}"
        return (
            f"{what} from {env.sender!r} skipped: it cannot follow from the log (last prepared "
            f"txn {self.last_txn}, last decided {self.last_decided}, undecided "
            f"{sorted(self.undecided) or 'none'})"
        )

    def apply(self, env: Envelope) -> bool:
        """Fold one message in; False (and nothing changed) when it is out of sequence
        (:meth:`out_of_sequence`).
        Duplicates and replays are harmless."""
        msg = env.payload
        if self.out_of_sequence(msg):
            return False
        if isinstance(msg, Prepare):
            if msg.txn > self.last_decided:
                self.undecided.add(msg.txn)
            self.last_txn = max(self.last_txn, msg.txn)
        elif isinstance(msg, Decision):
            self.apply_decision(msg)
        elif isinstance(msg, Applied):
            pending = self.pending.get(msg.txn)
            if pending is not None:
                pending.acked.add(msg.part)
        elif isinstance(msg, Complete):
            self.pending.pop(msg.txn, None)
        elif isinstance(msg, Checkpoint):
            self.apply_checkpoint(msg)
        return True

    def apply_decision(self, d: Decision) -> None:
        if d.txn in self.decisions or (d.txn <= self.last_decided and d.txn not in self.undecided):
            return  # a replay; the first decision for a transaction is the only one
        self.decisions[d.txn] = d
        while len(self.decisions) > DECISION_WINDOW:
            self.decisions.popitem(last=False)
        self.undecided.discard(d.txn)
        self.last_txn = max(self.last_txn, d.txn)
        self.last_decided = max(self.last_decided, d.txn)
        # Anything prepared below a decided transaction and never decided was never going to be.
        self.undecided = {t for t in self.undecided if t > self.last_decided}
        if d.outcome is Outcome.COMMIT:
            for pos in d.positions:
                self.positions[(pos.topic, pos.partition)] = pos.offset
            if d.parts:
                self.pending[d.txn] = Pending(d.txn, {p.participant: p for p in d.parts})

    def apply_checkpoint(self, c: Checkpoint) -> None:
        if c.last_txn < self.last_decided:
            return  # an older checkpoint seen after newer decisions: it adds nothing
        self.last_txn = max(self.last_txn, c.last_txn)
        self.last_decided = max(self.last_decided, c.last_txn)
        self.undecided = {t for t in self.undecided if t > self.last_decided}
        for pos in c.positions:
            self.positions[(pos.topic, pos.partition)] = pos.offset
        # Up to last_txn the checkpoint replaces what we knew, acknowledgements included: its
        # writer may not have read every APPLIED that landed before it, and a reader starting at
        # the checkpoint never will. Keeping our extra acks would leave us sure a part is acked
        # while the coordinator waits for it forever; forgetting them makes us re-ack it.
        for txn in [t for t in self.pending if t <= c.last_txn]:
            del self.pending[txn]
        for pc in c.pending:
            self.pending[pc.txn] = Pending(
                pc.txn, {p.participant: p for p in pc.parts}, set(pc.acked)
            )

    def outcome_of(self, txn: int, participant: str) -> Outcome | None:
        """COMMIT, ABORT, or None while undecided -- for ``participant``'s part of ``txn``."""
        decision = self.decisions.get(txn)
        if decision is not None:
            if decision.outcome is Outcome.COMMIT and decision.includes(participant):
                return Outcome.COMMIT
            return Outcome.ABORT
        pending = self.pending.get(txn)
        if pending is not None and participant in pending.parts:
            return Outcome.COMMIT
        if txn <= self.last_decided and txn not in self.undecided:
            return Outcome.ABORT  # presumed abort: no commit decision names this part
        return None

    def declared_sinks(self, txn: int, participant: str) -> tuple[str, ...] | None:
        """The sinks ``participant``'s committed part of ``txn`` was prepared in, as its vote
        (hence the decision, or the checkpoint's pending commit) says; None when unknown."""
        decision = self.decisions.get(txn)
        part = decision.includes(participant) if decision is not None else None
        if part is None and txn in self.pending:
            part = self.pending[txn].parts.get(participant)
        return part.sinks if part is not None else None

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(
            last_txn=self.last_decided,
            positions=tuple(Position(t, p, o) for (t, p), o in sorted(self.positions.items())),
            pending=tuple(p.to_message() for _, p in sorted(self.pending.items())),
        )
