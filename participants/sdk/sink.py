"""The contract every sink implements -- built-in or third-party.

Life cycle of one sink instance inside a participant process::

    setup()                                  once, before anything else
    in_doubt() -> commit()/abort() ...       recovery of earlier processes' parts
    stale_parts(t) -> abort() ...            open parts whose writer died (never prepared)
    begin(T) write(T, ..)* prepare(T, pos)   the open part, then its durable prepare
    begin(T+1) write(T+1, ..)* ...           the next part fills while T waits for its decision
    commit(T) | abort(T)                     the coordinator's decision, on the control thread
    close()

Rules a sink must keep (the conformance kit, :mod:`twophase.participants.sdk.testkit`, checks each one
against the real store; ``docs/write-a-sink.md`` walks through writing a sink that passes it):

**Parts.**

* At most one part is open at a time. ``begin`` while another part is open is a runtime bug: raise
  :class:`FatalSinkError`. ``begin`` of a part that is already prepared or committed raises too:
  a part id is never reused for other data.
* ``abort`` of an *open* part forgets it: ``begin`` with the same :class:`PartId` may follow. A
  rewind re-reads the same transaction's records, and the coordinator's transaction number is
  the part's name, so the same id is opened again -- also by a restarted process after a crash.

**Prepare.**

* ``prepare`` is durable: once it returns, ``commit`` of that part must succeed from any process,
  on new connections, after a crash of this one. It stores ``positions`` in the same local
  transaction as the data, together with a per-part marker, so the store itself can say whether
  a part is prepared, committed, or unknown.
* ``prepare`` repeated with the same positions after it succeeded is a no-op: the runtime repeats
  a prepare whose first attempt raised :class:`RetriableSinkError`, not knowing whether it landed.

**Decisions.**

* ``commit``, ``abort`` are idempotent by :class:`PartId`. ``commit`` of an already committed part
  is a no-op; of an unknown (or aborted) part raises :class:`UnknownPartError`. ``abort`` of an
  unknown or already aborted part is a no-op; ``abort`` of a committed part raises
  :class:`FatalSinkError`.
* Decisions are applied on a different thread from writes: ``commit``/``abort`` of a *prepared*
  part run on the control thread while ``begin``/``write``/``prepare`` work on the open part on the
  data thread. ``abort`` of the *open* part (a rewind) also comes from the control thread, possibly
  while a ``write`` of that part is in flight. A sink guards its own shared state accordingly
  (connections are not shared between the two threads without a lock).
* Nothing of a part is visible to readers of the target before ``commit``; after ``commit`` all of
  it is, exactly once, including after replays of the same decision.
* ``in_doubt`` lists every prepared, undecided part of *this pipeline* in the store -- from every
  participant, not only this one, and never another pipeline's -- so any live participant can
  finish a dead one's work.
* ``close()`` releases connections and keeps prepared parts prepared: they belong to the
  coordinator's decision, not to this process. An open part may be dropped.

**Failures** -- a sink never retries by itself; it raises, and the runtime acts by the branch:

* ``write`` raising :class:`RetriableSinkError` (or :class:`BackpressureError`) promises that the
  call left the part as it was before it: the runtime repeats the *same* call with the same
  records. A sink that cannot promise that (half a batch may have landed) raises
  :class:`AbortTransactionError` instead.
* ``write`` raising :class:`AbortTransactionError`: the open part is lost. The runtime aborts it
  and rewinds; every later ``write``/``prepare`` of that part should raise the same error.
* ``prepare`` raising :class:`RetriableSinkError`: the runtime repeats it with the same positions
  (hence the no-op rule above). :class:`AbortTransactionError`: the participant votes ABORT and
  the part is aborted.
* ``commit``/``abort`` raising :class:`RetriableSinkError` are repeated until they succeed (a
  decided part is applied however long the store needs).
* :class:`FatalSinkError` from any call stops the process with its message; prepared parts stay
  for recovery.
* Records the store refuses are not errors: ``write`` returns them as :class:`Rejected` (the runtime
  dead-letters them) and stores the rest of the batch. ``Rejected.extra`` uses these keys when it
  can: ``field`` (the record value's field at fault, dotted for nested ones), ``column`` (the
  store's column or attribute), ``sqlstate`` (the server's error code, for SQL stores); a sink may
  add its own keys. All values are strings.

**A record is all-or-nothing across sinks** -- one that any sink refuses reaches no sink:

* ``check(records)`` (optional, default: refuses nothing) returns the records this sink would
  refuse by its own rules -- conversion, naming, nesting depth, size -- without any store I/O
  and without changing the sink's state. The runtime asks every sink but the first before any
  sink writes a batch, dead-letters the union of what they refuse (naming the refusing sink and
  the reason) and offers the rest to every sink. Implement it with the *same* code as ``write``
  (never a second copy of the rules), so ``write`` of a checked record refuses only what the
  store itself refuses (a CHECK constraint, a unique index). Cheap: it runs on the hot path.
  Which records it refuses never depends on the other records of the batch or their order.
* A record that a later sink's ``write`` refuses after earlier sinks stored it is retracted by
  the runtime: the open part is aborted in every sink and re-read from its start, with that
  record left out before any sink writes (``control-topic/PROTOCOL.md``, "The record path").
  A sink needs nothing for this beyond the abort/rewind rules above.

**Targets** (optional): a sink that makes or changes its targets from the records -- a table
created from a record's schema, a column added by a newer one (``auto_create``,
``auto_evolve``) -- overrides :meth:`open_targets`. The runtime asks every sink, with the part
open, before any sink writes a batch; a sink makes what the records need inside the open part
(so a change commits with the part's first rows that need it, and is undone if the part aborts)
and returns

* :class:`Rejected` for records its target can never take (an incompatible schema change): they
  are dead-lettered before any sink writes them, as with :meth:`check`;
* :class:`Held` for records whose target cannot take them *now* (another participant is
  changing it, a lock is not free): they wait for a later part. A sink must never wait in
  ``open_targets`` or ``write`` for something another participant's *open* part holds: that
  part is decided only after this participant votes.

A sink that makes targets only under some options says so in :attr:`makes_targets`; the
runtime asks only sinks for which it is true.

**Raw values** (optional): a sink that can read JSON bytes faster than the runtime can decode
them overrides :meth:`accepts_raw` and :meth:`write_raw` (and :meth:`accepts_raw_shape` for
values that are more than the record: Debezium change events, keys that add fields). When every
sink of a pipeline accepts the source's raw values, the runtime skips decoding and calls
``write_raw`` with a :class:`RawBatch`; all the rules of ``write`` hold for it, and every value
must be either stored or asked for with ``RawBatch.record`` (which is how the runtime learns
what to dead-letter as undecodable). Such a sink that has a :meth:`check` also overrides
:meth:`check_raw`, or the runtime decodes every batch for the check; and one that makes targets
says, with :meth:`makes_targets_for`, which raw values need none (then it keeps its raw path).
:mod:`twophase.participants.sdk.rawjson` reads JSON values into Arrow by the runtime's rules.

**Housekeeping** (optional; defaults do nothing, and are right for a store that needs nothing):

* ``stale_parts(before_txn)`` lists parts that were begun and never prepared by a process that is
  gone, older than ``before_txn``; the runtime aborts them. Never this process's own open part.
* ``committed_positions()`` returns the source positions stored with committed data.
* ``forget(before_txn)`` deletes the markers of *decided* parts older than ``before_txn``.
* ``last_committed()`` returns the newest committed part of this pipeline in the store
  (:class:`CommittedInfo`: the highest transaction number, whose part, and when the store
  committed it if it records that), for operators (``twophase status``). Read from what the
  store keeps with committed data -- the per-part markers -- never from this process's memory:
  prepared, open and aborted parts never count, nor other pipelines', and it is the same from
  any process and after a restart. ``forget`` keeps what it needs: it never deletes the
  markers of the highest committed transaction. ``None`` means nothing is committed (or the
  default: the sink cannot tell).
"""

from __future__ import annotations

import abc
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, field_validator

from twophase.participants.sdk.records import (
    PLAIN_JSON,
    CommittedInfo,
    Held,
    PartId,
    Positions,
    RawBatch,
    RawShape,
    Record,
    Rejected,
    TopicPartition,
)

__all__ = ["Sink", "SinkConfig", "SinkContext"]


class SinkConfig(BaseModel):
    """Base of every sink's configuration model. Unknown keys are errors, so typos fail at start."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: The sink's name, unique in the pipeline; metrics, log lines and markers carry it.
    name: str
    #: The sink type: a built-in (``postgres``, ``mongodb``, ``files``, ``iceberg``) or an installed plugin's.
    type: str
    #: The source topics this sink takes, as Python regular expressions a whole topic name
    #: must match (``re.fullmatch``); empty (the default): every topic. The runtime hands the
    #: sink only records of those topics. A record of a topic no sink takes is dead-lettered
    #: with the reason.
    topics: tuple[str, ...] = ()

    @field_validator("topics")
    @classmethod
    def _topics_compile(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in value:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{pattern!r} is not a regular expression: {exc}") from None
        return value

    def takes(self, topic: str) -> bool:
        """Whether records of ``topic`` are this sink's (``topics``)."""
        return not self.topics or any(re.fullmatch(p, topic) for p in self.topics)


@dataclass(frozen=True, slots=True)
class SinkContext:
    """What the runtime tells a sink about where it runs."""

    pipeline: str
    participant: str
    sink_name: str
    logger: logging.Logger


class Sink(abc.ABC):
    """Base class of a sink. Subclasses set :attr:`config_model` and implement the abstract methods."""

    #: The pydantic model the runtime validates this sink's config section with.
    config_model: ClassVar[type[SinkConfig]] = SinkConfig

    def __init__(self, config: SinkConfig, context: SinkContext) -> None:
        self.config = config
        self.context = context
        self.log = context.logger

    @property
    def name(self) -> str:
        return self.context.sink_name

    @property
    def supports_deletes(self) -> bool:
        """True when the sink, as configured, applies deletes (:attr:`Record.deleted`): it
        removes the row, document or entry of the record's key in the same part, atomically
        with the rest, and a later write of that key brings it back. A pipeline whose sources
        can delete (a Debezium source, ``tombstones: delete``) refuses at start-up a sink that
        does not. Default: False."""
        return False

    @classmethod
    def from_mapping(cls, raw: dict[str, Any], context: SinkContext) -> Sink:
        """Validate ``raw`` with :attr:`config_model` and build the sink (pydantic names the field)."""
        return cls(cls.config_model.model_validate(raw), context)

    def owns(self, part: PartId) -> bool:
        """True when ``part`` belongs to this sink's pipeline (guards shared stores)."""
        return part.pipeline == self.context.pipeline

    # -- life cycle ------------------------------------------------------------------------

    @abc.abstractmethod
    def setup(self) -> None:
        """Connect, create what is missing (tables, staging areas), check server settings.

        Raise :class:`FatalSinkError` with a clear message when the store cannot do two-phase work.
        """

    @abc.abstractmethod
    def begin(self, part: PartId) -> None:
        """Open ``part``: from now on :meth:`write` adds to it.

        At most one part is open at a time: :class:`FatalSinkError` while another one is. Also
        after an ``abort`` of the same id (a rewind), and after a crash left it open.
        """

    @abc.abstractmethod
    def write(self, part: PartId, records: Sequence[Record]) -> Sequence[Rejected]:
        """Add ``records`` to the open ``part``; return those the store refuses, with reasons.

        :class:`RetriableSinkError` only when the call left the part as it was (it is repeated
        as is); :class:`AbortTransactionError` when the part is lost.
        """

    def check(self, records: Sequence[Record]) -> Sequence[Rejected]:
        """The records of ``records`` this sink's :meth:`write` would refuse by its own rules,
        with the same reasons -- asked before any sink writes the batch, so that a record one
        sink refuses reaches no sink. Pure: no store I/O, no change to the open part (it may be
        asked with no part open). The default refuses nothing.

        Use the same conversion code as :meth:`write`; refusals only the store can make (a
        constraint, a unique index) stay in :meth:`write`, where the runtime retracts them."""
        return ()

    def check_raw(self, batch: RawBatch) -> Sequence[Rejected] | None:
        """:meth:`check` of a batch whose values are still JSON bytes (asked instead of it when
        the runtime gives the sinks raw values): the same refusals, for the records
        ``batch.record(i)`` gives; values that are no record are skipped. None: decode the
        batch and ask :meth:`check` (the default)."""
        return None

    def open_targets(self, part: PartId, records: Sequence[Record]) -> Sequence[Rejected | Held]:
        """Make ready, inside the open ``part``, the targets ``records`` need (create, evolve);
        return the records whose target never can take them (:class:`Rejected`) and those
        that must wait for a later part (:class:`Held`). Asked before any sink writes the
        batch. The default has nothing to make."""
        return ()

    @property
    def makes_targets(self) -> bool:
        """True when :meth:`open_targets` has something to do as the sink is configured (asked
        after setup). The runtime asks only such sinks, and decodes every batch for them (no
        :meth:`write_raw`). Default: whether the class overrides :meth:`open_targets`; a sink
        that makes targets only under some options (``auto_create``) says so here, so that
        without them it keeps its raw path."""
        return type(self).open_targets is not Sink.open_targets

    def makes_targets_for(self, shape: RawShape) -> bool:
        """True when :meth:`open_targets` may have something to do for records read from raw
        values of ``shape`` (asked after setup, of sinks that :attr:`makes_targets`). False lets
        the runtime give this sink raw values without asking :meth:`open_targets` (a sink whose
        targets follow records' own schemas: plain JSON values carry none). Default:
        :attr:`makes_targets`."""
        return self.makes_targets

    def accepts_raw(self) -> bool:
        """True when :meth:`write_raw` is faster than decoding first (asked after setup), for
        values that are the records' JSON objects."""
        return False

    def accepts_raw_shape(self, shape: RawShape) -> bool:
        """True when :meth:`write_raw` reads values of ``shape`` (:class:`RawShape`: change
        events, keys that add fields) faster than decoding first (asked after setup).
        Default: plain JSON objects only, when :meth:`accepts_raw`."""
        return shape == PLAIN_JSON and self.accepts_raw()

    def write_raw(self, part: PartId, batch: RawBatch) -> Sequence[Rejected]:
        """:meth:`write` of a batch whose values are still JSON bytes (same rules and errors).

        Store each value, or take it from ``batch.record(i)``: None there means the value is not
        a JSON object (the runtime dead-letters it) and is skipped. The default decodes all."""
        return self.write(part, batch.records())

    @abc.abstractmethod
    def prepare(self, part: PartId, positions: Positions) -> None:
        """Make ``part`` durable and committable by any process; store ``positions`` with it.

        Repeated with the same positions after it succeeded: a no-op.
        """

    @abc.abstractmethod
    def commit(self, part: PartId) -> None:
        """Make ``part`` visible. Idempotent; works from any process after :meth:`prepare`.

        :class:`UnknownPartError` when the part is neither prepared nor committed here.
        """

    @abc.abstractmethod
    def abort(self, part: PartId) -> None:
        """Discard ``part``, open or prepared. Idempotent; no-op for unknown parts.

        :class:`FatalSinkError` when the part is already committed.
        """

    @abc.abstractmethod
    def in_doubt(self) -> list[PartId]:
        """Every prepared, undecided part of this pipeline in the store, from any participant."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. Prepared parts stay prepared; an open part may be dropped."""

    # -- housekeeping (optional) -------------------------------------------------------------

    def stale_parts(self, before_txn: int) -> list[PartId]:
        """Parts of this pipeline begun and never prepared by a process that is gone, with
        ``txn < before_txn``; the runtime aborts each one.

        The runtime passes a transaction number no live participant can still have open (the
        oldest undecided one), so a sink that cannot tell a live writer from a dead one may rely
        on it; a sink that can (a lock the kernel drops) may check both. Never returns this
        process's own open part, nor prepared parts (those are :meth:`in_doubt`). The default
        suits stores that drop an unprepared part with its writer's connection (PostgreSQL).
        """
        return []

    def committed_positions(self) -> dict[TopicPartition, int]:
        """Next offset per source partition, as stored with the committed data of this pipeline.

        Stored in the same local transaction as the data, so it is never ahead of it. Empty when
        the sink does not store positions where a reader can get them (the default).
        """
        return {}

    def maintain(self) -> Mapping[str, Any] | None:
        """Upkeep of the store that no part needs but readers and writers gain from over time
        (the iceberg sink: compaction, snapshot expiry, unreferenced files), run by ``twophase
        sinks maintain``; what it did. Must never race a commit nor remove what a committed
        part or a prepared one needs. None: nothing to maintain (the default)."""
        return None

    def forget(self, before_txn: int) -> int:
        """Delete the markers of decided (committed or aborted) parts with ``txn < before_txn``.

        Markers make decisions idempotent; once the decision log is past a transaction nobody
        repeats its decision, and without this they grow by one per part forever. Prepared parts,
        data, :meth:`committed_positions` and :meth:`last_committed` are untouched: the markers
        of the highest committed transaction stay whatever ``before_txn`` is. Returns how many
        were deleted.
        """
        return 0

    def last_committed(self) -> CommittedInfo | None:
        """The newest committed part of this pipeline in the store: highest ``txn``, whose part,
        and ``committed_at`` (UTC) when the store records commit times.

        From the store's own records of committed parts (never from this instance's memory), so
        any process gets the same answer, also after a restart and after :meth:`forget`; parts
        that are open, prepared or aborted never count. Applied out of order, an older part
        committed last does not replace a newer one. None when nothing of this pipeline is
        committed here -- and the default, for a sink that cannot tell (``twophase status``
        tells the two apart by whether a sink overrides this method).
        """
        return None
