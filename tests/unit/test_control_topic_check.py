"""What the start-up check of the control topic cannot check is logged, never raised: a start-up
does not end on a broker that does not answer, a topic whose metadata is in error, settings the
principal may not read or a reply that never comes. (Its refusals, on a real broker:
tests/e2e/test_control_topic_checked.py.) The admin client here is a stand-in that fails the
way librdkafka's calls fail; nothing about Kafka itself is asserted."""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from twophase.config import PipelineConfig, parse_config
from twophase.errors import ConfigError
from twophase.kafka import check_control_topic


def _cfg() -> PipelineConfig:
    raw = {
        "pipeline": "p",
        "kafka": {"bootstrap_servers": "k:9092"},
        "sources": [{"topic": "t"}],
        "sinks": [{"name": "f", "type": "files", "path": "/tmp/x"}],
    }
    return parse_config(raw, env={})


@dataclass
class _Entry:
    value: str | None


@dataclass
class _Meta:
    partitions: dict[int, Any]
    error: KafkaError | None = None


@dataclass
class _Admin:
    """``list_topics`` and ``describe_configs`` as librdkafka's AdminClient answers them."""

    partitions: int = 1
    meta_error: KafkaError | None = None
    list_fails: bool = False
    #: "ok", "denied" (the per-resource future fails) or "silent" (it never completes).
    configs: str = "ok"
    policy: str | None = "delete"
    asked: list[str] = field(default_factory=list)

    def list_topics(self, *, timeout: float) -> Any:
        self.asked.append("metadata")
        if self.list_fails:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT))
        topic = _Meta({i: None for i in range(self.partitions)}, self.meta_error)
        return type("M", (), {"topics": {"twophase.control.p": topic}})()

    def describe_configs(self, resources: list[Any], *, request_timeout: float) -> Any:
        self.asked.append("configs")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self.configs == "denied":
            future.set_exception(KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)))
        elif self.configs == "ok":
            future.set_result({"cleanup.policy": _Entry(self.policy)})
        return {resources[0]: future}


@pytest.mark.parametrize(
    "admin",
    [
        _Admin(list_fails=True),
        _Admin(meta_error=KafkaError(KafkaError.LEADER_NOT_AVAILABLE)),
        _Admin(configs="denied"),
        _Admin(configs="silent"),
        _Admin(policy=None),
    ],
    ids=["no-metadata", "metadata-error", "configs-denied", "configs-never-answered", "no-policy"],
)
def test_what_cannot_be_checked_is_logged_not_raised(
    admin: _Admin, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="twophase.kafka"):
        check_control_topic(_cfg(), admin, timeout_s=0.01)  # type: ignore[arg-type]
    if admin.policy is not None:
        assert "twophase.control.p" in caplog.text


def test_a_missing_topic_is_left_to_the_readers() -> None:
    class Missing(_Admin):
        def list_topics(self, *, timeout: float) -> Any:
            return type("M", (), {"topics": {}})()

    admin = Missing()
    check_control_topic(_cfg(), admin)  # type: ignore[arg-type]
    assert admin.asked == []


@pytest.mark.parametrize(
    ("admin", "says"),
    [(_Admin(partitions=3), "3 partitions"), (_Admin(policy="compact"), "cleanup.policy=compact")],
)
def test_the_refusals_name_the_field_and_the_setting(admin: _Admin, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_control_topic(_cfg(), admin)  # type: ignore[arg-type]
    assert err.value.field == "control.topic" and says in str(err.value)
