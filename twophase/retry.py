"""One retry policy for every store and Kafka call: what is retried, for how long, how long it
waits in between, and what it logs. Built on tenacity; nothing else in the product loops on an
error.

What is retried follows the three branches of :mod:`twophase.errors`: a ``RetriableError``
(every ``RetriableSinkError`` is one) is retried; an ``AbortError`` or a ``FatalError`` goes to
the caller at once, which aborts the part or stops. A Kafka call's ``KafkaException`` is
retriable when librdkafka says so, or when it is one of the answers a restarting broker or a
moving group coordinator gives for a while -- never when librdkafka calls it fatal.

How long: every budget is below, each with the reason for its value. A budget is the time
after which no new try starts (a try never starts when its wait would end past the budget); a
set ``stop`` event ends the tries at the next failure.

How it waits: exponential back-off from ``first_wait_s`` to ``max_wait_s``, each wait drawn
from 50-150 % of its step so that two processes that conflicted once (a write conflict in a
shared store) do not collide again in lockstep. An error that carries ``retry_after_s`` (a
store asking to slow down: ``BackpressureError``) is waited exactly that long instead.

Each retry is logged at WARNING with what was tried -- the callers name the transaction, the
sink and the partitions in ``what`` -- the try number, the wait and the error.
"""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from confluent_kafka import KafkaError, KafkaException
from tenacity import (
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
    stop_when_event_set,
)
from tenacity.stop import stop_base

from twophase.errors import RetriableError

__all__ = [
    "CLI_RESOLVE_RETRY_S",
    "CLI_SETUP_RETRY_S",
    "DISK_FULL_RETRY_S",
    "EARLY_ABORT_S",
    "KAFKA",
    "KAFKA_RETRY_S",
    "SINK_RETRY_S",
    "SPARK_APPLY_S",
    "SPARK_PUBLISH_ATTEMPTS",
    "STORE",
    "STORE_OR_KAFKA",
    "STATUS_PROBE_RETRY_S",
    "STORE_WAIT_S",
    "TXN_COMMIT",
    "TXN_COMMIT_ATTEMPTS",
    "Policy",
    "kafka_commit_retriable",
    "kafka_retriable",
    "retriable",
]

log = logging.getLogger("twophase.retry")
T = TypeVar("T")

# -- budgets -----------------------------------------------------------------------------------

#: Default of ``participant.sink_retry_s``, and the Spark writer's budget for the same calls: a
#: sink call whose failure the process survives (a write: the part is re-read; a prepare: an
#: abort vote; a sweep: the next one tries again). A minute rides out a lock wait or a store's
#: restart; past it, giving the part up costs less than holding every other sink's part open.
SINK_RETRY_S = 60.0
#: A call the process cannot go on without (applying a decision, start-up recovery): retried
#: until it succeeds or the process stops. Giving up would only end the process and hand the
#: same wait to its restart, while the prepared part holds its rows invisible either way.
STORE_WAIT_S = math.inf
#: A blocking Kafka call that a broker restart fails: the group coordinator moves and loads its
#: offsets within seconds of the broker being back. Past this the error is raised as it is (the
#: process exits and is restarted).
KAFKA_RETRY_S = 60.0
#: The Spark driver applying a decided part. A participant waits for ever (``STORE_WAIT_S``);
#: the driver runs inside the user's query, where waiting for ever is a query that hangs with no
#: error, while a failed call loses nothing -- the decision stays in the log, and the replay of
#: the batch when the query restarts applies it -- and says which store is down. Ten minutes
#: ride out a store's restart or failover.
SPARK_APPLY_S = 600.0
#: Tries at one control-topic write of the Spark driver whose transaction Kafka asked to abort
#: (a broker failing over). The coordinator tries once: its next tick publishes again anyway.
SPARK_PUBLISH_ATTEMPTS = 5
#: A Spark task aborting its own part before it reports a failure: only a head start, since
#: the driver aborts every part of a failed attempt again.
EARLY_ABORT_S = 10.0

#: ``twophase status`` reports a sink it cannot reach rather than waiting for it: a probe must
#: answer quickly.
STATUS_PROBE_RETRY_S = 5.0
#: ``twophase txn``: connecting to a sink. A store that keeps refusing this long is down, and the
#: operator is better served by being told so than by waiting (the command can be run again).
CLI_SETUP_RETRY_S = 10.0
#: ``twophase txn resolve``: the protocol's sink retry budget (PROTOCOL.md, "Timeouts") -- a
#: part busy in another session clears within a commit.
CLI_RESOLVE_RETRY_S = SINK_RETRY_S
#: What the files sink asks for (``BackpressureError.retry_after_s``) when the disk is full:
#: freeing space takes an operator or a retention job, not milliseconds, and a full disk should
#: not turn into a busy retry loop.
DISK_FULL_RETRY_S = 30.0

# -- what is retriable ---------------------------------------------------------------------------

#: What a restarting broker or a moving group coordinator answers for a while, though
#: librdkafka does not flag all of them retriable.
_KAFKA_TRANSIENT = frozenset(
    {
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.NETWORK_EXCEPTION,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._WAIT_COORD,
    }
)


def retriable(exc: BaseException) -> bool:
    """Store calls: the error says the same call may succeed."""
    return isinstance(exc, RetriableError)


def kafka_retriable(exc: BaseException) -> bool:
    """Kafka calls: transient by librdkafka's word or a known transient code, never fatal."""
    if not isinstance(exc, KafkaException):
        return False
    err = exc.args[0] if exc.args else None
    return (
        isinstance(err, KafkaError)
        and not err.fatal()
        and (err.retriable() or err.code() in _KAFKA_TRANSIENT)
    )


def kafka_commit_retriable(exc: BaseException) -> bool:
    """A transaction's commit: librdkafka allows a commit that failed retriably, and needs no
    abort, to be simply tried again; one that needs an abort goes back to the caller."""
    if not isinstance(exc, KafkaException):
        return False
    err = exc.args[0] if exc.args else None
    return (
        isinstance(err, KafkaError)
        and err.retriable()
        and not err.txn_requires_abort()
        and not err.fatal()
    )


def _store_or_kafka(exc: BaseException) -> bool:
    return retriable(exc) or kafka_retriable(exc)


# -- the policy ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """Which errors are retried, the default budget, and the back-off between tries."""

    name: str
    retry_if: Callable[[BaseException], bool]
    budget_s: float
    first_wait_s: float
    max_wait_s: float

    def wait(self, state: RetryCallState) -> float:
        """The store's own ``retry_after_s`` if it gave one, else the jittered back-off."""
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, RetriableError) and exc.retry_after_s is not None:
            return exc.retry_after_s
        step: float = min(self.first_wait_s * 2.0 ** (state.attempt_number - 1), self.max_wait_s)
        return step * random.uniform(0.5, 1.5)

    def call(
        self,
        fn: Callable[[], T],
        what: str,
        *,
        budget_s: float | None = None,
        attempts: int | None = None,
        stop: threading.Event | None = None,
        give_up: type[RetriableError] | None = None,
        logger: logging.Logger = log,
    ) -> T:
        """``fn()``, retried under this policy for ``budget_s`` (default: the policy's) and at
        most ``attempts`` tries, until ``stop`` is set.

        A non-retriable error is raised at once, as it is. When the tries run out the last
        error is raised as it is -- or, with ``give_up``, as that class naming ``what`` and
        why the tries ended ("gave up after 60s", "stopped while retrying"), for callers
        that handle every exhausted call the same way.
        """
        budget = self.budget_s if budget_s is None else budget_s
        ends: stop_base = stop_before_delay(budget)
        if attempts is not None:
            ends = ends | stop_after_attempt(attempts)
        if stop is not None:
            ends = ends | stop_when_event_set(stop)

        def note(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            wait = state.next_action.sleep if state.next_action is not None else 0.0
            logger.warning(
                "%s failed (try %d), retrying in %.2fs: %s", what, state.attempt_number, wait, exc
            )

        retrying = Retrying(
            retry=retry_if_exception(self.retry_if),
            stop=ends,
            wait=self.wait,
            before_sleep=note,
            reraise=False,
        )
        try:
            return retrying(fn)
        except RetryError as tries:
            last = tries.last_attempt.exception()
            assert last is not None  # tenacity gives up only on a failed try
            if give_up is None:
                raise last from None
            if stop is not None and stop.is_set():
                raise give_up(f"{what}: stopped while retrying: {last}") from last
            if attempts is not None and tries.last_attempt.attempt_number >= attempts:
                raise give_up(f"{what}: gave up after {attempts} tries: {last}") from last
            raise give_up(f"{what}: gave up after {budget:.0f}s: {last}") from last


#: Sink and store calls.
STORE = Policy("store", retriable, SINK_RETRY_S, first_wait_s=0.05, max_wait_s=2.0)
#: Blocking Kafka client calls (offsets, watermarks, metadata, a transaction's commit). Waits
#: up to 5 s: short enough to notice the broker back promptly.
KAFKA = Policy("kafka", kafka_retriable, KAFKA_RETRY_S, first_wait_s=0.25, max_wait_s=5.0)
#: Committing a Kafka transaction: a few quick tries, then the caller aborts the transaction
#: (it holds a control message or a decision, which the caller publishes again or gives up).
TXN_COMMIT = Policy(
    "kafka transaction commit",
    kafka_commit_retriable,
    KAFKA_RETRY_S,
    first_wait_s=0.05,
    max_wait_s=0.5,
)
TXN_COMMIT_ATTEMPTS = 5
#: Calls that touch both (the at-least-once runtime's commit of offsets after a sink's).
STORE_OR_KAFKA = Policy(
    "store or kafka", _store_or_kafka, SINK_RETRY_S, first_wait_s=0.05, max_wait_s=2.0
)
