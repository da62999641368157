"""A bad sink section fails at start-up naming ``sinks[i].field``, and never echoes a secret held
in it: sink sections go through the same ``validation_error`` masking as the pipeline's own."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import model_validator

import twophase.participants.registry as registry
from twophase.errors import ConfigError
from twophase.participants.registry import build_sinks
from twophase.participants.sdk import Sink, SinkConfig

DSN_SECRET = "hunter2-dsn-4f1c"
PASSWORD_SECRET = "hunter2-pw-9b7e"


def _pg_section(**changes: Any) -> dict[str, Any]:
    return {
        "name": "pg",
        "type": "postgres",
        "dsn": f"postgresql://app:{DSN_SECRET}@db.example.com/app",
        "password": PASSWORD_SECRET,
        "table": "orders",
        **changes,
    }


def _shown(err: ConfigError) -> str:
    return f"{err} {err.field} {err.args!r}"


def test_a_wrong_type_in_a_postgres_section_names_the_field_and_hides_the_dsn() -> None:
    files = {"name": "files", "type": "files", "path": "/tmp/x"}
    with pytest.raises(ConfigError) as caught:
        build_sinks(
            [files, _pg_section(connect_timeout_s="soon")],
            pipeline="orders",
            participant="p",
            source="pipeline.yaml",
        )
    err = caught.value
    assert err.field == "sinks[1].connect_timeout_s"
    assert "pipeline.yaml" in str(err)
    assert DSN_SECRET not in _shown(err) and PASSWORD_SECRET not in _shown(err)


class _CarelessConfig(SinkConfig):
    """A plugin whose validator quotes its whole section (secrets included) in its message."""

    dsn: str
    password: str
    retries: int = 3

    @model_validator(mode="after")
    def _check(self) -> _CarelessConfig:
        if self.retries > 10:
            raise ValueError(f"too many retries for {self.dsn} (password {self.password})")
        return self


class _CarelessSink(Sink):
    config_model = _CarelessConfig


def test_a_plugin_message_quoting_a_secret_is_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "sink_class", lambda type_name: _CarelessSink)
    section = {
        "name": "careless",
        "type": "careless",
        "dsn": f"postgresql://app:{DSN_SECRET}@db/app",
        "password": PASSWORD_SECRET,
        "retries": 11,
    }
    with pytest.raises(ConfigError) as caught:
        build_sinks([section], pipeline="orders", participant="p", source="pipeline.yaml")
    err = caught.value
    assert err.field.startswith("sinks[0]")
    assert "too many retries" in str(err) and "***" in str(err)
    assert DSN_SECRET not in _shown(err) and PASSWORD_SECRET not in _shown(err)
