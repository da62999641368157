"""The rules of #14 that need no store: the sink retry budget is a setting, the one validation,
and a taken metrics port named by its setting (the retries themselves: test_retry.py)."""

from __future__ import annotations

import socket

import pytest

from twophase.config import parse_config
from twophase.errors import ConfigError
from twophase.observability import HealthServer, Metrics
from twophase.participants.registry import check_config

BASE = {
    "pipeline": "p",
    "kafka": {"bootstrap_servers": "127.0.0.1:1"},
    "sources": [{"topic": "t"}],
    "sinks": [{"name": "out", "type": "files", "path": "/tmp/x"}],
}


def test_sink_retry_s_is_a_setting_and_must_be_positive() -> None:
    cfg = parse_config({**BASE, "participant": {"sink_retry_s": 2.5}})
    assert cfg.participant.sink_retry_s == 2.5
    with pytest.raises(ConfigError, match=r"participant\.sink_retry_s"):
        parse_config({**BASE, "participant": {"sink_retry_s": 0}})


def test_check_config_rejects_what_validate_rejects() -> None:
    cfg = parse_config({**BASE, "sinks": [{"name": "out", "type": "postgress"}]})
    with pytest.raises(ConfigError, match=r"sinks\[0\]\.type.*unknown sink type 'postgress'"):
        check_config(cfg)
    assert check_config(parse_config(BASE)).pipeline == "p"


def test_a_taken_port_names_metrics_port() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    server = HealthServer(Metrics("p", "test"), ready=lambda: True, status=dict)
    try:
        with pytest.raises(ConfigError, match=rf"metrics\.port.*127\.0\.0\.1:{port}"):
            server.start("127.0.0.1", port)
    finally:
        holder.close()
