"""The contract every sink implements -- built-in or third-party.

Life cycle of one sink instance inside a participant process::

    setup()                                  once, before anything else
    in_doubt() -> commit()/abort() ...       recovery of earlier processes' parts
    begin(T) write(T, ..)* prepare(T, pos)   the open part, then its durable prepare
    begin(T+1) write(T+1, ..)* ...           the next part fills while T waits for its decision
    commit(T) | abort(T)                     the coordinator's decision, possibly on another thread
    close()

Rules a sink must keep (the conformance kit in :mod:`participants.sdk.testkit` checks them):

* ``prepare`` is durable: once it returns, ``commit`` of that part must succeed from any process,
  on new connections, after a crash of this one. It stores ``positions`` in the same local
  transaction as the data, together with a per-part marker, so the store itself can say whether
  a part is prepared, committed, or unknown.
* ``abort`` of an *open* part forgets it: ``begin`` with the same :class:`PartId` may follow. A
  rewind re-reads the same transaction's records, and the coordinator's transaction number is
  the part's name, so the same id is opened again.
* ``commit``, ``abort`` are idempotent by :class:`PartId`. ``commit`` of an already committed part
  is a no-op; of an unknown part raises :class:`UnknownPartError`. ``abort`` of an unknown or
  already aborted part is a no-op; ``abort`` of a committed part raises ``FatalSinkError``.
* Nothing of a part is visible to readers of the target before ``commit``; after ``commit`` all of
  it is, exactly once, including after replays of the same part.
* ``commit``/``abort`` of a *prepared* part may run on another thread while ``begin``/``write``
  work on the open part; a sink guards its own shared state accordingly.
* ``in_doubt`` lists every prepared, undecided part of *this pipeline* in the store -- from every
  participant, not only this one -- so any live participant can finish a dead one's work.
* A sink never retries by itself: it raises :class:`RetriableSinkError` /
  :class:`BackpressureError` and the runtime retries; records it cannot store are returned from
  ``write`` as :class:`Rejected` and dead-lettered by the runtime.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from participants.sdk.records import PartId, Positions, Record, Rejected

__all__ = ["Sink", "SinkConfig", "SinkContext"]


class SinkConfig(BaseModel):
    """Base of every sink's configuration model. Unknown keys are errors, so typos fail at start."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    type: str


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
        """Open ``part``: from now on :meth:`write` adds to it. At most one part is open at a time."""

    @abc.abstractmethod
    def write(self, part: PartId, records: Sequence[Record]) -> Sequence[Rejected]:
        """Add ``records`` to the open ``part``; return those that cannot be stored, with reasons."""

    @abc.abstractmethod
    def prepare(self, part: PartId, positions: Positions) -> None:
        """Make ``part`` durable and committable by any process; store ``positions`` with it."""

    @abc.abstractmethod
    def commit(self, part: PartId) -> None:
        """Make ``part`` visible. Idempotent; works from any process after :meth:`prepare`."""

    @abc.abstractmethod
    def abort(self, part: PartId) -> None:
        """Discard ``part``, open or prepared. Idempotent; no-op for unknown parts."""

    @abc.abstractmethod
    def in_doubt(self) -> list[PartId]:
        """Every prepared, undecided part of this pipeline in the store, from any participant."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. Prepared parts stay prepared."""
