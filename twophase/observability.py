"""Metrics, health and logging shared by the coordinator and the participants.

Every process serves ``/metrics`` (Prometheus), ``/healthz`` (alive: the main loop ran recently)
and ``/readyz`` (ready: a participant has its assignment and is caught up; a coordinator has
reached Kafka -- it leads, or stands by after joining the group or reading metadata) on one port.

A log line about a transaction carries structured fields (see :func:`txn_extra`): ``txn`` and
the source partitions it covers -- ``topic`` and ``partition`` when it is one, ``partitions``
(``["topic[p]", ...]``) otherwise. :func:`log_context` lends them to every line logged while
a transaction's work runs, including lines of code that knows nothing about transactions (a
sink, a retry loop, librdkafka).
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from twophase.errors import ConfigError

__all__ = ["HealthServer", "Metrics", "configure_logging", "log_context", "txn_extra"]

#: A main loop that has not ticked for this long is reported dead: well above the slowest
#: legitimate step (a sink prepare under load), well below Kubernetes' default probe patience.
LIVENESS_STALL_S = 60.0

_PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """All metrics of one process, in its own registry (tests run several in one interpreter)."""

    def __init__(self, pipeline: str, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.cycles = Counter(
            "twophase_commit_cycles",
            "Commit cycles by outcome",
            ["pipeline", "outcome"],
            registry=r,
        )
        self.cycle_seconds = Histogram(
            "twophase_cycle_phase_seconds",
            "Commit cycle latency per phase (prepare->votes, decision write, apply, total)",
            ["pipeline", "phase"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.records = Counter(
            "twophase_sink_records", "Records written per sink", ["pipeline", "sink"], registry=r
        )
        self.bytes = Counter(
            "twophase_sink_bytes", "Bytes written per sink", ["pipeline", "sink"], registry=r
        )
        self.dead_lettered = Counter(
            "twophase_dead_lettered_records",
            "Records sent to the dead-letter topic",
            ["pipeline", "reason"],
            registry=r,
        )
        self.control_skipped = Counter(
            "twophase_control_messages_skipped",
            "Control messages skipped (malformed, unknown type, future version, bad HMAC, "
            "foreign pipeline, out of sequence)",
            ["pipeline", "kind"],
            registry=r,
        )
        self.in_doubt = Gauge(
            "twophase_in_doubt_parts",
            "Prepared parts awaiting a decision",
            ["pipeline"],
            registry=r,
        )
        self.deleted_unread = Counter(
            "twophase_source_offsets_deleted_unread",
            "Source offsets found deleted from the topic (retention, DeleteRecords) before "
            "the pipeline delivered them, when a partition was resumed",
            ["pipeline", "topic", "partition"],
            registry=r,
        )
        self.lag = Gauge(
            "twophase_consumer_lag",
            "Records behind the end of each source partition",
            ["pipeline", "topic", "partition"],
            registry=r,
        )
        self.leader = Gauge(
            "twophase_leader", "1 while this coordinator leads", ["pipeline"], registry=r
        )
        self.fenced = Counter(
            "twophase_fencing_events", "Times this coordinator was fenced", ["pipeline"], registry=r
        )
        self.alarm = Gauge(
            "twophase_alarm",
            "1 while consecutive commit cycles keep failing",
            ["pipeline"],
            registry=r,
        )
        self.stalled = Gauge(
            "twophase_stalled_partitions",
            "Source partitions whose records have waited commit.stall_alarm_s or longer while "
            "no commit moved their position (leader only)",
            ["pipeline"],
            registry=r,
        )
        self.stalled_seconds = Gauge(
            "twophase_partition_stalled_seconds",
            "Seconds a source partition's records have waited since a commit last moved its "
            "position (0 when none wait; leader only)",
            ["pipeline", "topic", "partition"],
            registry=r,
        )
        self.rewinds = Counter(
            "twophase_rewinds", "Open parts abandoned and re-read", ["pipeline"], registry=r
        )
        self.markers_forgotten = Counter(
            "twophase_markers_forgotten",
            "Markers of decided parts the sinks deleted (participant.keep_decided_txns)",
            ["pipeline", "sink"],
            registry=r,
        )
        self.last_commit = Gauge(
            "twophase_last_commit_timestamp_seconds",
            "When the last commit was decided/applied",
            ["pipeline"],
            registry=r,
        )
        self.pipeline = pipeline
        self.role = role

    def render(self) -> bytes:
        return generate_latest(self.registry)


class HealthServer:
    """``/metrics``, ``/healthz``, ``/readyz`` on one port, in a daemon thread."""

    def __init__(
        self, metrics: Metrics, ready: Callable[[], bool], status: Callable[[], dict[str, Any]]
    ) -> None:
        self.metrics = metrics
        self.ready = ready
        self.status = status
        self.last_beat = time.monotonic()
        self.port = 0  # the bound port once started (useful with port 0)
        self._server: ThreadingHTTPServer | None = None

    def beat(self) -> None:
        self.last_beat = time.monotonic()

    def alive(self) -> bool:
        return time.monotonic() - self.last_beat < LIVENESS_STALL_S

    def start(self, host: str, port: int) -> int:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path == "/metrics":
                    self._send(200, outer.metrics.render(), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    ok = outer.alive()
                    self._send(200 if ok else 503, b"ok\n" if ok else b"stalled\n")
                elif path == "/readyz":
                    ok = outer.alive() and outer.ready()
                    self._send(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
                elif path == "/status":
                    body = json.dumps(outer.status(), default=str).encode()
                    self._send(200, body, "application/json")
                else:
                    self._send(404, b"not found\n")

            def _send(self, code: int, body: bytes, ctype: str = "text/plain") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # probes every few seconds would drown the real logs

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            # The one port every process opens: say which setting to change, in one line
            # (a raw OSError traceback named neither the port nor the setting).
            raise ConfigError(
                "metrics.port",
                f"cannot listen on {host}:{port}: {exc.strerror or exc} "
                "(another process holds the port? set metrics.port or TWOPHASE__METRICS__PORT)",
            ) from None
        threading.Thread(target=self._server.serve_forever, daemon=True, name="health").start()
        self.port = int(self._server.server_address[1])
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


#: Structured fields a log line may carry; the JSON format emits each one present.
LOG_FIELDS = ("pipeline", "txn", "topic", "partition", "partitions", "participant", "sink")

_context: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "twophase_log_context", default=None
)


def txn_extra(txn: int, partitions: Iterable[tuple[str, int]], **fields: Any) -> dict[str, Any]:
    """``extra=`` for a line about transaction ``txn`` covering these source partitions:
    ``topic`` and ``partition`` when it is one, else ``partitions`` (possibly empty: unknown)."""
    tps = sorted(set(partitions))
    out: dict[str, Any] = {**fields, "txn": txn}
    if len(tps) == 1:
        out["topic"], out["partition"] = tps[0]
    else:
        out["partitions"] = [f"{t}[{p}]" for t, p in tps]
    return out


@contextmanager
def log_context(fields: Mapping[str, Any]) -> Iterator[None]:
    """Every line logged in this thread inside the block carries ``fields`` unless it names
    its own (a line about another transaction keeps its own ``txn`` and partitions)."""
    token = _context.set({**(_context.get() or {}), **fields})
    try:
        yield
    finally:
        _context.reset(token)


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        fields = _context.get()
        if not fields:
            return True
        own_txn = getattr(record, "txn", None)
        if own_txn and own_txn != fields.get("txn"):
            return True  # about another transaction: its partitions are not ours to add
        has_tps = hasattr(record, "partitions") or hasattr(record, "topic")
        for key, value in fields.items():
            if key in ("topic", "partition", "partitions") and has_tps:
                continue
            if getattr(record, key, None) in (None, 0, ""):
                setattr(record, key, value)
        return True


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in LOG_FIELDS:
            value = getattr(record, key, None)
            if value is not None and not (key == "txn" and value == 0):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _TextFormatter(logging.Formatter):
    """``time LEVEL logger message``, then the transaction and partitions the line is about when
    the message does not say them already: ``[txn=12 orders[0],orders[1]]``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        message = record.getMessage()
        tags: list[str] = []
        txn = getattr(record, "txn", None)
        if txn and f"txn={txn}" not in message:
            tags.append(f"txn={txn}")
        topic, partition = getattr(record, "topic", None), getattr(record, "partition", None)
        partitions = getattr(record, "partitions", None)
        if topic is not None and partition is not None:
            tp = f"{topic}[{partition}]"
            if tp not in message:
                tags.append(tp)
        elif partitions:
            tags.append(",".join(str(x) for x in partitions))
        if not tags:
            return line
        head, sep, tail = line.partition("\n")  # keep a traceback below the tagged first line
        return f"{head} [{' '.join(tags)}]{sep}{tail}"


def configure_logging(fmt: str | None = None, level: str | None = None) -> None:
    """Entry points only. ``TWOPHASE_LOG_FORMAT=json|text``, ``TWOPHASE_LOG_LEVEL``."""
    fmt = fmt or os.environ.get("TWOPHASE_LOG_FORMAT", "text")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter())
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level or os.environ.get("TWOPHASE_LOG_LEVEL", "INFO"))
