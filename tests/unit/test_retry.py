"""``twophase.retry``: the one retry policy -- what is retried, for how long, how it waits, what
it logs -- and that no other product module keeps a retry budget of its own."""

from __future__ import annotations

import ast
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException

from twophase import retry
from twophase.errors import AbortError, FatalError, RetriableError
from twophase.participants.sdk import BackpressureError, FatalSinkError, RetriableSinkError
from twophase.retry import KAFKA, STORE, STORE_OR_KAFKA, STORE_WAIT_S, TXN_COMMIT

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def waits(recorded_sleeps: list[float]) -> list[float]:
    """Every wait the policy asks for in the test's thread, instead of sleeping it."""
    return recorded_sleeps


def failing(*errors: BaseException) -> tuple[Callable[[], str], list[int]]:
    """Raises each error in turn, then answers "ok"; counts the calls."""
    todo = list(errors)
    calls = [0]

    def call() -> str:
        calls[0] += 1
        if todo:
            raise todo.pop(0)
        return "ok"

    return call, calls


def kafka_error(code: int, **kw: bool) -> KafkaException:
    return KafkaException(KafkaError(code, **kw))


# -- Kafka calls ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code",
    [
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
    ],
)
def test_what_a_broker_restart_answers_is_retried_until_the_call_answers(
    code: int, waits: list[float]
) -> None:
    call, calls = failing(*[kafka_error(code)] * 7)
    assert KAFKA.call(call, "committed") == "ok"
    assert calls[0] == 8 and len(waits) == 7
    # Doubling from 0.25 s up to 5 s, each wait drawn from 50-150 % of its step.
    steps = [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    for wait, step in zip(waits, steps, strict=True):
        assert 0.5 * step <= wait <= 1.5 * step


def test_fatal_and_other_kafka_errors_are_raised_at_once(waits: list[float]) -> None:
    call, _ = failing(kafka_error(KafkaError.NOT_COORDINATOR, fatal=True))
    with pytest.raises(KafkaException) as err:
        KAFKA.call(call, "committed")
    assert err.value.args[0].fatal()
    call, _ = failing(kafka_error(KafkaError.GROUP_AUTHORIZATION_FAILED))
    with pytest.raises(KafkaException) as err:
        KAFKA.call(call, "committed")
    assert err.value.args[0].code() == KafkaError.GROUP_AUTHORIZATION_FAILED
    assert waits == []


def test_a_retriable_error_past_the_budget_is_raised_as_it_is(waits: list[float]) -> None:
    call, _ = failing(*[kafka_error(KafkaError.NOT_COORDINATOR)] * 100)
    with pytest.raises(KafkaException) as err:
        KAFKA.call(call, "x", budget_s=0.1)
    assert err.value.args[0].code() == KafkaError.NOT_COORDINATOR
    assert waits == []  # the first wait (at least 0.125 s) would already pass the budget


def test_a_set_stop_ends_the_retries(waits: list[float]) -> None:
    stop = threading.Event()
    stop.set()
    call, calls = failing(kafka_error(KafkaError._TIMED_OUT))
    with pytest.raises(KafkaException):
        KAFKA.call(call, "x", stop=stop)
    assert calls[0] == 1 and waits == []


def test_a_transaction_commit_is_tried_a_few_times_unless_it_needs_an_abort(
    waits: list[float],
) -> None:
    retriable = KafkaError(KafkaError._TIMED_OUT, retriable=True)
    call, calls = failing(*[KafkaException(retriable)] * 2)
    assert TXN_COMMIT.call(call, "commit", attempts=5, give_up=RetriableError) == "ok"
    assert calls[0] == 3
    call, calls = failing(*[KafkaException(retriable)] * 10)
    with pytest.raises(RetriableError, match="commit: gave up after 5 tries"):
        TXN_COMMIT.call(call, "commit", attempts=5, give_up=RetriableError)
    assert calls[0] == 5
    aborts = KafkaError(KafkaError._TIMED_OUT, retriable=True, txn_requires_abort=True)
    call, calls = failing(KafkaException(aborts))
    with pytest.raises(KafkaException):
        TXN_COMMIT.call(call, "commit", attempts=5, give_up=RetriableError)
    assert calls[0] == 1


# -- store calls ---------------------------------------------------------------------------------


def test_a_budget_gives_up_and_says_after_how_long() -> None:
    call, _ = failing(*[RetriableSinkError("store not answering")] * 1000)
    with pytest.raises(RetriableError, match="op: gave up after 0s: store not answering"):
        STORE.call(call, "op", budget_s=0.2, give_up=RetriableError)


def test_without_give_up_the_last_error_is_raised_as_it_is() -> None:
    call, _ = failing(*[RetriableSinkError("store not answering")] * 1000)
    with pytest.raises(RetriableSinkError, match=r"^store not answering$"):
        STORE.call(call, "op", budget_s=0.2)


def test_the_store_wait_outlasts_any_budget() -> None:
    call, calls = failing(*[RetriableSinkError("down")] * 40)
    assert STORE.call(call, "op", budget_s=STORE_WAIT_S) == "ok"
    assert calls[0] == 41
    # The same failures with a budget: given up.
    call, _ = failing(*[RetriableSinkError("down")] * 40)
    with pytest.raises(RetriableError):
        STORE.call(call, "op", budget_s=0.3, give_up=RetriableError)


def test_the_store_wait_ends_when_the_process_stops() -> None:
    stop = threading.Event()
    stop.set()
    call, calls = failing(*[RetriableSinkError("down")] * 1000)
    with pytest.raises(RetriableError, match="op: stopped while retrying: down"):
        STORE.call(call, "op", budget_s=STORE_WAIT_S, stop=stop, give_up=RetriableError)
    assert calls[0] == 1


def test_backpressure_waits_what_the_store_asks(waits: list[float]) -> None:
    call, _ = failing(
        BackpressureError("slow down", retry_after_s=3.5),
        BackpressureError("slow down", retry_after_s=0.01),
    )
    assert STORE.call(call, "op") == "ok"
    assert waits == [3.5, 0.01]


@pytest.mark.parametrize(
    "error",
    [AbortError("part lost"), FatalError("bad password"), FatalSinkError("no table"), KeyError()],
)
def test_abort_fatal_and_unexpected_errors_are_not_retried(
    error: BaseException, waits: list[float]
) -> None:
    call, calls = failing(error)
    with pytest.raises(type(error)):
        STORE.call(call, "op", give_up=RetriableError)
    assert calls[0] == 1 and waits == []


def test_store_or_kafka_retries_both_and_only_those(waits: list[float]) -> None:
    call, calls = failing(RetriableSinkError("lock"), kafka_error(KafkaError._TRANSPORT))
    assert STORE_OR_KAFKA.call(call, "op") == "ok"
    assert calls[0] == 3
    call, _ = failing(kafka_error(KafkaError.TOPIC_AUTHORIZATION_FAILED))
    with pytest.raises(KafkaException):
        STORE_OR_KAFKA.call(call, "op")
    # A Kafka error is not a store's: the store policy leaves it to the caller.
    call, calls = failing(kafka_error(KafkaError._TRANSPORT))
    with pytest.raises(KafkaException):
        STORE.call(call, "op")
    assert calls[0] == 1


def test_each_retry_is_one_warning_naming_the_call_the_try_and_the_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="twophase.retry")
    call, _ = failing(RetriableSinkError("lock timeout"), RetriableSinkError("lock timeout"))
    STORE.call(call, "txn=7 write pg orders[0]")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("txn=7 write pg orders[0] failed (try 1), retrying in ")
    assert lines[1].startswith("txn=7 write pg orders[0] failed (try 2), retrying in ")
    assert all(line.endswith(": lock timeout") for line in lines)


# -- one place -----------------------------------------------------------------------------------

PRODUCT = ["twophase", "coordinator", "participants", "jobs", "cli"]


def _budgets(path: Path) -> list[str]:
    """Module-level names of ``path`` that look like a retry budget or a try count."""
    found = []
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Name) and (
                "RETRY" in t.id or t.id.endswith(("_BUDGET_S", "_ATTEMPTS"))
            ):
                found.append(t.id)
    return found


def test_retry_budgets_live_only_in_the_retry_module() -> None:
    # twophase/ links the other folders in: each file once, by its real path.
    files = {p.resolve() for top in PRODUCT for p in (ROOT / top).rglob("*.py")}
    own = Path(retry.__file__).resolve()
    elsewhere = {
        str(p.relative_to(ROOT)): names for p in sorted(files - {own}) if (names := _budgets(p))
    }
    assert elsewhere == {}
    assert {"SINK_RETRY_S", "KAFKA_RETRY_S", "TXN_COMMIT_ATTEMPTS"} <= set(_budgets(own))


def test_the_budget_rule_sees_a_budget() -> None:
    """The scan above can fail: it finds budgets the way they were written before."""
    sample = ROOT / "tests" / "unit" / "_budget_sample.py"
    sample.write_text("SINK_RETRY_BUDGET_S = 60.0\nPUBLISH_ATTEMPTS: int = 5\nOTHER = 1\n")
    try:
        assert _budgets(sample) == ["SINK_RETRY_BUDGET_S", "PUBLISH_ATTEMPTS"]
    finally:
        sample.unlink()
