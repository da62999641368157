"""librdkafka's error callback once the broker has refused the process: the clients' echoes of
the refusal (all brokers down, the transport cut) are not repeated -- the refusal is said once,
as the error raised -- while any other error still reaches the log."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import KafkaError

from twophase.kafka import BrokerAuthError, _BrokerAccess, _on_error


@pytest.fixture
def fresh_access(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("twophase.kafka._access", _BrokerAccess())


def _refuse() -> None:
    with pytest.raises(BrokerAuthError, match="Authentication failed"):
        _on_error(KafkaError(KafkaError._AUTHENTICATION, "Authentication failed"))


@pytest.mark.usefixtures("fresh_access")
def test_after_a_refusal_only_its_echoes_are_quiet(caplog: pytest.LogCaptureFixture) -> None:
    down = KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down")
    cut = KafkaError(KafkaError._TRANSPORT, "Disconnected")
    other = KafkaError(KafkaError._MSG_TIMED_OUT, "message timed out")
    with caplog.at_level(logging.DEBUG, logger="twophase.kafka"):
        _on_error(down)  # before any refusal: said
        assert [r.levelno for r in caplog.records] == [logging.WARNING]
        caplog.clear()
        _refuse()
        _on_error(KafkaError(KafkaError._AUTHENTICATION, "Authentication failed"))  # not again
        _on_error(down)
        _on_error(cut)
        assert all(r.levelno == logging.DEBUG for r in caplog.records), caplog.text
        _on_error(other)
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
            "Kafka: message timed out"
        ]
