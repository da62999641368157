"""The rules of #14 that need no store: how long a sink call is retried, the one validation,
and a taken metrics port named by its setting."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import pytest

from twophase.config import parse_config
from twophase.errors import ConfigError, RetriableError
from twophase.observability import HealthServer, Metrics
from twophase.participants.registry import check_config
from twophase.participants.runtime.batch import STORE_WAIT_S, retry_call
from twophase.participants.sdk import RetriableSinkError

BASE = {
    "pipeline": "p",
    "kafka": {"bootstrap_servers": "127.0.0.1:1"},
    "sources": [{"topic": "t"}],
    "sinks": [{"name": "out", "type": "files", "path": "/tmp/x"}],
}


def failing(times: int) -> tuple[Callable[[], str], list[int]]:
    calls = [0]

    def fn() -> str:
        calls[0] += 1
        if calls[0] <= times:
            raise RetriableSinkError("store not answering")
        return "done"

    return fn, calls


def test_a_budget_gives_up_and_says_after_how_long() -> None:
    fn, _ = failing(1000)
    with pytest.raises(RetriableError, match="gave up after 0s"):
        retry_call(fn, "op", 0.2, threading.Event())


def test_the_store_wait_outlasts_any_budget() -> None:
    fn, calls = failing(5)
    assert retry_call(fn, "op", STORE_WAIT_S, threading.Event()) == "done"
    assert calls[0] == 6
    # The same failures with a budget: given up.
    fn, _ = failing(5)
    with pytest.raises(RetriableError):
        retry_call(fn, "op", 0.3, threading.Event())


def test_the_store_wait_ends_when_the_process_stops() -> None:
    stop = threading.Event()
    stop.set()
    fn, calls = failing(1000)
    with pytest.raises(RetriableError, match="stopped while retrying"):
        retry_call(fn, "op", STORE_WAIT_S, stop)
    assert calls[0] == 1


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
