"""Error classes a sink raises, in the three branches the runtime knows how to handle.

The vocabulary follows librdkafka's transactional API on purpose:

* :class:`RetriableSinkError` -- transient (connection reset, lock timeout). The runtime retries the
  same call after a back-off; the transaction stays alive.
* :class:`BackpressureError` -- a retriable error that says how long to wait.
* :class:`AbortTransactionError` -- this transaction cannot be completed (constraint the whole batch
  violates, server refused the prepare). The runtime votes ABORT / aborts the part and rewinds.
* :class:`FatalSinkError` -- configuration or server state that a retry will not fix
  (``max_prepared_transactions = 0``, missing permissions). The process stops with this message.

Per-record problems are not exceptions: :meth:`Sink.write` returns them as
:class:`~twophase.participants.sdk.records.Rejected` so the runtime can dead-letter them and go on.
"""

from __future__ import annotations

from twophase.errors import AbortError, FatalError, RetriableError

__all__ = [
    "AbortTransactionError",
    "BackpressureError",
    "FatalSinkError",
    "RetriableSinkError",
    "SinkError",
    "UnknownPartError",
]


class SinkError(Exception):
    """Root of every error a sink raises. ``sink`` names the sink instance for the operator."""

    def __init__(self, message: str, *, sink: str = "") -> None:
        super().__init__(f"[{sink}] {message}" if sink else message)
        self.sink = sink


class RetriableSinkError(SinkError, RetriableError):
    """Transient: the runtime retries the same call; the transaction stays alive."""


class BackpressureError(RetriableSinkError):
    """The store asks us to slow down; the runtime waits ``retry_after_s`` before retrying."""

    def __init__(self, message: str, *, retry_after_s: float, sink: str = "") -> None:
        super().__init__(message, sink=sink)
        self.retry_after_s = retry_after_s


class AbortTransactionError(SinkError, AbortError):
    """This part cannot be prepared or written; the runtime aborts it and rewinds."""


class FatalSinkError(SinkError, FatalError):
    """Retrying cannot help (bad config, server setting, permissions); the process stops."""


class UnknownPartError(FatalSinkError):
    """commit() named a part that is neither prepared nor committed in this store.

    Seen when a decision is applied against the wrong store, or when a prepare was lost -- which
    the protocol forbids, so it is fatal rather than silently ignored.
    """
