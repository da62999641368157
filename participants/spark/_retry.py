"""How long the coordinated writer retries a sink call, and the one loop that does it.

Every budget of the writer is here, each with the reason for its value.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from twophase.participants.sdk import BackpressureError, RetriableSinkError

__all__ = ["APPLY_RETRY_BUDGET_S", "EARLY_ABORT_BUDGET_S", "SINK_RETRY_BUDGET_S", "retry"]

log = logging.getLogger("twophase.spark")
T = TypeVar("T")

#: Retriable sink errors (lock timeouts, a store restarting) are retried this long in a task,
#: as the participant runtime does, before the part is given up and the batch aborted; on the
#: driver, this long for listing parts and for aborting a dead attempt's part.
SINK_RETRY_BUDGET_S = 60.0
#: Committing a part the log decided (and aborting one it decided against) is retried this
#: long before the batch call fails. A participant waits for its store for ever instead
#: (``STORE_WAIT_S``): giving up would only end the process and hand the same wait to its
#: restart. The driver runs inside the user's query, where waiting
#: for ever means a query that hangs with no error, while a failed call loses nothing -- the
#: decision stays in the log, and the replay of the batch when the query restarts applies it
#: -- and says which store is down. Ten minutes rides out a store's restart or failover.
APPLY_RETRY_BUDGET_S = 600.0
#: A task aborting its own part before it reports a failure: only a head start, since the
#: driver aborts every part of a failed attempt again.
EARLY_ABORT_BUDGET_S = 10.0


def retry(call: Callable[[], T], *, budget_s: float, what: str) -> T:
    """Run ``call``, repeating it on retriable sink errors until ``budget_s`` is spent."""
    deadline = time.monotonic() + budget_s
    backoff = 0.05
    last: RetriableSinkError
    while True:
        try:
            return call()
        except BackpressureError as exc:
            wait, last = exc.retry_after_s, exc
        except RetriableSinkError as exc:
            wait, last = backoff, exc
            backoff = min(backoff * 2, 2.0)
        if time.monotonic() + wait > deadline:
            raise last
        log.info("%s: %s; retrying in %.2fs", what, last, wait)
        time.sleep(wait)
