"""``twophase.kafka.retry_kafka``: what a broker restart makes blocking Kafka calls raise
(NOT_COORDINATOR, time-outs) is retried within a budget; anything else is raised at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from confluent_kafka import KafkaError, KafkaException

from twophase import kafka
from twophase.kafka import retry_kafka


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    waits: list[float] = []
    monkeypatch.setattr(time, "sleep", waits.append)
    return waits


def failing(*errors: KafkaError) -> Callable[[], str]:
    """Raises each error in turn, then answers "ok"."""
    todo = list(errors)

    def call() -> str:
        if todo:
            raise KafkaException(todo.pop(0))
        return "ok"

    return call


@pytest.mark.parametrize(
    "code",
    [
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
    ],
)
def test_retriable_errors_are_retried_until_the_call_answers(
    code: int, no_sleep: list[float]
) -> None:
    assert retry_kafka(failing(*[KafkaError(code)] * 6), "committed") == "ok"
    # A growing back-off, bounded.
    assert no_sleep == sorted(no_sleep) and len(no_sleep) == 6
    assert max(no_sleep) <= kafka.KAFKA_RETRY_MAX_WAIT_S


def test_fatal_and_other_errors_are_raised_at_once(no_sleep: list[float]) -> None:
    fatal = KafkaError(KafkaError.NOT_COORDINATOR, fatal=True)
    with pytest.raises(KafkaException) as err:
        retry_kafka(failing(fatal), "committed")
    assert err.value.args[0].fatal()
    with pytest.raises(KafkaException) as err:
        retry_kafka(failing(KafkaError(KafkaError.GROUP_AUTHORIZATION_FAILED)), "committed")
    assert err.value.args[0].code() == KafkaError.GROUP_AUTHORIZATION_FAILED
    assert no_sleep == []


def test_a_retriable_error_past_the_budget_is_raised(no_sleep: list[float]) -> None:
    with pytest.raises(KafkaException) as err:
        retry_kafka(failing(*[KafkaError(KafkaError.NOT_COORDINATOR)] * 100), "x", budget_s=0.2)
    assert err.value.args[0].code() == KafkaError.NOT_COORDINATOR
    assert no_sleep == []  # the first wait (0.25 s) would already pass the budget


def test_stop_ends_the_retries(no_sleep: list[float]) -> None:
    stop = threading.Event()
    stop.set()
    with pytest.raises(KafkaException):
        retry_kafka(failing(KafkaError(KafkaError._TIMED_OUT)), "x", stop=stop)
    assert no_sleep == []
