"""A base class for sinks over a store with local transactions but no two-phase commit.

Most stores (SQLite, MySQL without XA, DuckDB, a key-value store, an object store with a manifest)
can be made exactly-once the same way: each ``write`` stages its batch where readers do not look,
a per-part *marker* says whether the part is open, prepared, committed or aborted, and ``commit``
moves the staged data into the target and flips the marker in one local transaction.
:class:`BatchingSink` does the part of that which is the same for every store -- the open part,
the marker's state machine, idempotent and repeated calls, the two threads, the error branches --
and leaves a subclass the store's own operations, each one local transaction:

===================================  ===========================================================
``stage(part, records)``             add one batch to the part's staging area; return rejections
``publish(part)``                    if the marker says prepared: staged data -> target, marker ->
                                     committed, positions stored -- atomically; else nothing
``discard(part)``                    marker -> aborted unless committed, staged data deleted
``save_marker(marker, expect=...)``  compare-and-set the marker: write it if the stored state is
                                     one of ``expect`` (``None`` = no marker)
``load_marker(part)``                the stored marker, or ``None``
``list_parts(state)``                parts of this pipeline and sink in that state
===================================  ===========================================================

Everything else -- ``begin``/``write``/``prepare``/``commit``/``abort``/``in_doubt``/``stale_parts``
-- comes from here and keeps the rules of :mod:`twophase.participants.sdk.sink`:

* ``stage`` runs on the data thread while ``publish``/``discard``/``load_marker`` run on the
  control thread: use a connection per thread, or one connection under a lock.
* ``stage`` is atomic, or repeatable: if it raises :class:`RetriableSinkError`, the runtime
  repeats the same call, and the part must then hold the batch once (nothing of it landed, or
  what landed is recognised, as the MongoDB sink does by deterministic ids). Any other error
  loses the part: later writes and the prepare raise :class:`AbortTransactionError` until it
  is aborted. So does a ``save_marker`` of the ``prepared`` marker that raises anything but
  :class:`RetriableSinkError`.
* Staged data must be durable when ``save_marker`` of the ``prepared`` marker returns: that is the
  prepare, and from then on any process can ``publish``. Data a store buffers in memory (the
  files sink's open files) is written there, before the marker.
* Markers are keyed by sink name and part (two sinks may share one marker table).
* A store operation may keep what it needs of the open part in memory (buffers, a lock) in an
  :class:`OpenSlot`: the ``open`` marker starts it, the ``prepared`` marker or ``discard`` ends it.

Optional: :meth:`BatchingSink.abandoned` says whether an open part's writer is gone (by default:
the part is older than the runtime's bound); a store that can tell a live writer from a dead
one better -- the files sink holds a ``flock`` -- overrides it.

The methods of the contract are ``final``: a subclass changes what the store does, never the
rules around it.

Example: ``examples/twophase-sqlite-sink`` (about 200 lines); guide: ``docs/write-a-sink.md``.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar, final

from twophase.participants.sdk.errors import (
    AbortTransactionError,
    FatalSinkError,
    RetriableSinkError,
    SinkError,
    UnknownPartError,
)
from twophase.participants.sdk.records import (
    PartId,
    Positions,
    RawBatch,
    Record,
    Rejected,
    TopicPartition,
)
from twophase.participants.sdk.sink import Sink, SinkConfig, SinkContext

__all__ = [
    "BatchingSink",
    "OpenSlot",
    "PartMarker",
    "PartState",
    "positions_from_json",
    "positions_to_json",
]

PartState = Literal["open", "prepared", "committed", "aborted"]
_OPEN: tuple[PartState] = ("open",)


@dataclass(frozen=True, slots=True)
class PartMarker:
    """What the store records about one part of one sink.

    ``positions`` and ``records`` are set by the prepare; ``publish`` stores the positions with
    the data (for :meth:`~twophase.participants.sdk.Sink.committed_positions`).
    """

    part: PartId
    state: PartState
    positions: Mapping[TopicPartition, int] = field(default_factory=dict)
    records: int = 0


def positions_to_json(positions: Positions) -> list[dict[str, Any]]:
    """``positions`` the way the built-in sinks store them in a marker (JSON or BSON): a list of
    ``{"topic", "partition", "offset"}``, sorted, so that equal positions store equal."""
    return [
        {"topic": topic, "partition": partition, "offset": offset}
        for (topic, partition), offset in sorted(positions.items())
    ]


def positions_from_json(items: Any) -> dict[TopicPartition, int]:
    """The positions :func:`positions_to_json` stored (the highest offset of a partition that
    repeats); ``ValueError``, ``KeyError`` or ``TypeError`` for anything else."""
    if not isinstance(items, list):
        raise ValueError(f"positions: expected a list, got {type(items).__name__}")
    out: dict[TopicPartition, int] = {}
    for item in items:
        tp = (str(item["topic"]), int(item["partition"]))
        out[tp] = max(out.get(tp, 0), int(item["offset"]))
    return out


_T = TypeVar("_T")


class OpenSlot(Generic[_T]):
    """What a store operation keeps in memory about the open part (buffers, a lock, counters):
    put there by ``save_marker`` of the ``open`` marker, taken by that of the ``prepared`` marker
    or by ``discard``. Thread-safe: ``discard`` runs on the control thread, and a ``begin`` of the
    next part may put while it takes another part's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: tuple[PartId, _T] | None = None

    def put(self, part: PartId, value: _T) -> None:
        with self._lock:
            self._held = (part, value)

    def get(self, part: PartId, *, take: bool = False) -> _T | None:
        """What is held for ``part`` (None for any other part); with ``take``, no longer held."""
        with self._lock:
            if self._held is None or self._held[0] != part:
                return None
            value = self._held[1]
            if take:
                self._held = None
            return value

    def held(self) -> tuple[PartId, _T] | None:
        """The part something is held for, and what."""
        with self._lock:
            return self._held


@dataclass(slots=True)
class _OpenPart:
    part: PartId
    #: Held by a write or prepare in flight; an abort from the control thread waits for it.
    lock: threading.Lock = field(default_factory=threading.Lock)
    records: int = 0
    rejected: int = 0
    #: Why the part can no longer be prepared (a failed stage, an abort); None while healthy.
    broken: str | None = None


class BatchingSink(Sink):
    """Exactly-once over any store with local transactions: implement the six store methods."""

    def __init__(self, config: SinkConfig, context: SinkContext) -> None:
        super().__init__(config, context)
        self._guard = threading.Lock()  # guards _open (the field, not the part's work)
        self._open: _OpenPart | None = None

    # -- the store's operations: what a subclass implements ------------------------------------

    @abc.abstractmethod
    def stage(self, part: PartId, records: Sequence[Record]) -> Sequence[Rejected]:
        """Stage one batch of the open ``part``, invisible to readers; atomic; the refusals."""

    @abc.abstractmethod
    def publish(self, part: PartId) -> None:
        """In one local transaction, if ``part`` is prepared: move its staged data into the target,
        set its marker to committed and store its positions. Otherwise change nothing.

        A store whose transactions cannot hold a whole part commits it in steps instead, each
        repeatable by any process after a crash, the marker last (the MongoDB sink's chunks, the
        files sink's links and manifest). Raising :class:`UnknownPartError` here when the part
        turns out to be neither prepared nor committed is fine: :meth:`commit` would."""

    @abc.abstractmethod
    def discard(self, part: PartId) -> None:
        """Mark ``part`` aborted unless it is committed (or has no marker); delete its staged data.
        A store may remove the marker instead: no marker is as good as ``aborted``.

        Called only for parts that are not committed; the guard is for a store shared with a
        misbehaving writer.
        """

    @abc.abstractmethod
    def save_marker(self, marker: PartMarker, *, expect: Collection[PartState | None]) -> bool:
        """Write ``marker`` if the stored state of its part is in ``expect``; whether it did."""

    @abc.abstractmethod
    def load_marker(self, part: PartId) -> PartMarker | None:
        """The stored marker of ``part`` in this sink, or None."""

    @abc.abstractmethod
    def list_parts(self, state: PartState) -> list[PartId]:
        """Every part of this pipeline (``self.context.pipeline``) and sink in ``state``."""

    # -- the Sink contract, built on them -------------------------------------------------------

    @final
    def begin(self, part: PartId) -> None:
        self._require_owned(part)
        with self._guard:
            if self._open is not None:
                raise FatalSinkError(
                    f"begin({part.token}) while part {self._open.part.token} is open: "
                    "prepare or abort it first",
                    sink=self.name,
                )
        marker = self.load_marker(part)
        if marker is not None and marker.state in ("prepared", "committed"):
            raise FatalSinkError(
                f"begin: part {part.token} is already {marker.state}; a part id is never reused",
                sink=self.name,
            )
        # Leftovers of an earlier attempt under the same id (a rewind, a crash) go first.
        self.discard(part)
        if not self.save_marker(PartMarker(part, "open"), expect=(None, "aborted")):
            raise RetriableSinkError(f"begin: part {part.token} changed meanwhile", sink=self.name)
        with self._guard:
            self._open = _OpenPart(part)
        self.log.debug("part %s: open", part.token)

    @final
    def write(self, part: PartId, records: Sequence[Record]) -> Sequence[Rejected]:
        def stage() -> tuple[Sequence[Rejected], int]:
            return (self.stage(part, records) if records else []), len(records)

        return self._write(part, stage)

    @final
    def write_raw(self, part: PartId, batch: RawBatch) -> Sequence[Rejected]:
        """:meth:`stage_raw` of the batch, or :meth:`stage` of its records when it declines."""

        def stage() -> tuple[Sequence[Rejected], int]:
            staged = self.stage_raw(part, batch) if len(batch) else []
            if staged is not None:
                # Values that turned out to be no record were skipped: not counted as staged.
                return staged, len(batch) - len(batch.known_undecodable())
            records = batch.records()
            return (self.stage(part, records) if records else []), len(records)

        return self._write(part, stage)

    def stage_raw(self, part: PartId, batch: RawBatch) -> Sequence[Rejected] | None:
        """Optional: :meth:`stage` of a batch whose values are still JSON bytes (the runtime
        offers it when :meth:`~twophase.participants.sdk.Sink.accepts_raw` says so). Stage
        every value exactly as :meth:`stage` would stage its record and return the refusals;
        or stage nothing and return None, and the batch is decoded and given to :meth:`stage`.
        A value ``batch.record(i)`` finds to be no record is skipped (the runtime
        dead-letters it). Atomic, like :meth:`stage`. Default: None."""
        return None

    def _write(
        self, part: PartId, stage: Callable[[], tuple[Sequence[Rejected], int]]
    ) -> Sequence[Rejected]:
        op = self._writable(part, "write")
        with op.lock:
            self._check_healthy(op)
            try:
                staged, n = stage()
                rejected = list(staged)
            except RetriableSinkError:
                raise  # stage is atomic: nothing landed, the runtime repeats the call
            except Exception as exc:
                op.broken = f"a write failed: {exc}"
                raise
            op.records += n - len(rejected)
            op.rejected += len(rejected)
        if rejected:
            self.log.info(
                "part %s: %d of %d records rejected (first: %s)",
                part.token,
                len(rejected),
                n,
                rejected[0].reason,
            )
        return rejected

    @final
    def prepare(self, part: PartId, positions: Positions) -> None:
        with self._guard:
            op = self._open if self._open is not None and self._open.part == part else None
        if op is None:
            self._prepare_again(part, positions)
            return
        with op.lock:
            self._check_healthy(op)
            marker = PartMarker(part, "prepared", dict(positions), op.records)
            try:
                saved = self.save_marker(marker, expect=_OPEN)
            except RetriableSinkError:
                raise  # the marker did not change: the runtime repeats the prepare
            except Exception as exc:
                op.broken = f"the prepare failed: {exc}"
                raise
            if not saved:
                # A first attempt that raised may have landed; anything else is an abort by
                # another process (stale-part clean-up) behind this one's back.
                try:
                    self._prepare_again(part, positions)
                except SinkError as exc:
                    op.broken = str(exc)
                    raise
            with self._guard:
                if self._open is op:
                    self._open = None
        self.log.info(
            "part %s: prepared %d records (%d rejected)", part.token, op.records, op.rejected
        )

    @final
    def commit(self, part: PartId) -> None:
        self._require_owned(part)
        self.publish(part)
        marker = self.load_marker(part)
        if marker is None or marker.state != "committed":
            state = marker.state if marker is not None else "unknown"
            raise UnknownPartError(
                f"commit: part {part.token} is {state} here, not prepared", sink=self.name
            )
        self.log.info("part %s: committed", part.token)

    @final
    def abort(self, part: PartId) -> None:
        self._require_owned(part)
        with self._guard:
            op = self._open if self._open is not None and self._open.part == part else None
        if op is not None:
            with op.lock:  # waits for a write in flight on the data thread
                op.broken = "aborted"
                with self._guard:
                    if self._open is op:
                        self._open = None
        marker = self.load_marker(part)
        if marker is not None and marker.state == "committed":
            raise FatalSinkError(f"abort: part {part.token} is already committed", sink=self.name)
        self.discard(part)
        self.log.info("part %s: aborted", part.token)

    @final
    def in_doubt(self) -> list[PartId]:
        return sorted(p for p in self.list_parts("prepared") if self.owns(p))

    @final
    def stale_parts(self, before_txn: int) -> list[PartId]:
        """Open parts of this pipeline whose writer is gone (:meth:`abandoned`: by default, those
        older than ``before_txn``), but this process's own."""
        with self._guard:
            mine = self._open.part if self._open is not None else None
        return sorted(
            p
            for p in self.list_parts("open")
            if p != mine and self.owns(p) and self.abandoned(p, before_txn)
        )

    def abandoned(self, part: PartId, before_txn: int) -> bool:
        """Whether the writer of the open ``part`` is gone, so that :meth:`stale_parts` lists it.

        The default relies on the runtime's bound: no live participant still has a part older
        than ``before_txn`` open. A store that can tell a dead writer from a live one (a lock
        the kernel drops with its holder) overrides it, and may then ignore ``before_txn``.
        """
        return part.txn < before_txn

    # -- internals -----------------------------------------------------------------------------

    def _require_owned(self, part: PartId) -> None:
        if not self.owns(part):
            raise FatalSinkError(
                f"part {part.token} belongs to pipeline {part.pipeline!r}, not "
                f"{self.context.pipeline!r}",
                sink=self.name,
            )

    def _writable(self, part: PartId, action: str) -> _OpenPart:
        with self._guard:
            op = self._open
        if op is None or op.part != part:
            raise AbortTransactionError(
                f"{action}: part {part.token} is not open here (never begun, aborted, or prepared)",
                sink=self.name,
            )
        return op

    def _check_healthy(self, op: _OpenPart) -> None:
        if op.broken is not None:
            raise AbortTransactionError(
                f"part {op.part.token} can only be aborted: {op.broken}", sink=self.name
            )

    def _prepare_again(self, part: PartId, positions: Positions) -> None:
        """prepare() of a part not open here: fine if it is prepared with these positions."""
        marker = self.load_marker(part)
        if marker is None or marker.state not in ("prepared", "committed"):
            state = marker.state if marker is not None else "unknown"
            raise AbortTransactionError(
                f"prepare: part {part.token} is {state} here, not open", sink=self.name
            )
        if dict(marker.positions) != dict(positions):
            raise FatalSinkError(
                f"prepare: part {part.token} is already {marker.state} with other positions",
                sink=self.name,
            )
