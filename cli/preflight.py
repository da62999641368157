"""``twophase validate --live``: what a coordinator and a participant check at start-up, run
against the real Kafka and stores, so a config that would stop a process is caught before it
is deployed.

Nothing is copied: Kafka is reached (and its credentials tried) with the same
:func:`twophase.kafka.await_broker` both processes start with, and every sink runs its own
``setup()`` -- the checks a participant runs before it reads a record (PostgreSQL's
``max_prepared_transactions``, the target table and its columns, a MongoDB replica set, a
writable directory...). Like a participant, set-up creates what a sink creates when missing
(marker tables, staging collections, a target table with ``create_table``).
"""

from __future__ import annotations

import threading
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from twophase.cli.txn import Progress, open_sinks
from twophase.config import PipelineConfig
from twophase.errors import FatalError
from twophase.kafka import await_broker, client_settings
from twophase.participants.sdk import SinkError

__all__ = ["live_checks"]


def _quiet(_note: str) -> None:
    pass


def live_checks(
    cfg: PipelineConfig, *, timeout_s: float, progress: Progress = _quiet
) -> dict[str, Any]:
    """``{"kafka": ..., "topics": ..., "sinks": {name: "ok" | error}, "problems": [...]}``.

    A store or broker that does not answer within ``timeout_s`` is a problem here (a running
    process would wait for it); an authentication or set-up refusal is the problem it names.
    """
    problems: list[str] = []
    result: dict[str, Any] = {"pipeline": cfg.pipeline, "kafka": "ok", "topics": {}, "sinks": {}}
    progress(f"reaching Kafka at {cfg.kafka.bootstrap_servers}")
    admin = AdminClient(client_settings(cfg, "admin"))
    try:
        reached = await_broker(admin, timeout_s, threading.Event())
    except FatalError as exc:  # BrokerAuthError: the broker refused these credentials
        reached = False
        result["kafka"] = str(exc)
        problems.append(f"kafka: {exc}")
    else:
        if not reached:
            result["kafka"] = f"no answer within {timeout_s:.0f}s"
            problems.append(
                f"kafka: {cfg.kafka.bootstrap_servers} did not answer within {timeout_s:.0f}s"
            )
    if reached:
        progress("reading the topics")
        try:
            topics = admin.list_topics(timeout=timeout_s).topics
        except KafkaException as exc:
            problems.append(f"kafka: cannot list topics: {exc}")
            topics = {}
        wanted = list(cfg.source_topics)
        if cfg.participant.mode == "exactly_once":
            wanted = [cfg.control_topic, *wanted]
        for name in wanted:
            meta = topics.get(name)
            if meta is None or meta.error is not None:
                result["topics"][name] = "missing"
                problems.append(f"topic {name} does not exist (run `twophase topics create`)")
                continue
            result["topics"][name] = f"{len(meta.partitions)} partitions"
            if name == cfg.control_topic and len(meta.partitions) != 1:
                problems.append(
                    f"control topic {name} has {len(meta.partitions)} partitions; the protocol "
                    "needs exactly 1"
                )
        if cfg.participant.mode == "exactly_once":
            # Not a problem when missing: the replies then go to the control topic, as before.
            meta = topics.get(cfg.reply_topic)
            result["topics"][cfg.reply_topic] = (
                f"{len(meta.partitions)} partitions"
                if meta is not None and meta.error is None
                else "missing: votes go to the control topic, which every participant reads"
            )
        for source in cfg.sources:
            if source.topic_pattern:
                matched = [t for t in cfg.resolve_topics(topics) if cfg.source_for(t) is source]
                result["topics"][source.name] = f"{len(matched)} topics match"
    # The participant's own start-up step: every sink's setup(), retrying retriable errors.
    sinks, errors = open_sinks(cfg, retry_s=timeout_s, progress=progress)
    for sink in sinks:
        result["sinks"][sink.name] = "ok"
        try:
            sink.close()
        except SinkError as exc:  # checked and closing: nothing is lost, say it anyway
            result["sinks"][sink.name] = f"ok (close: {exc})"
    for name, error in sorted(errors.items()):
        result["sinks"][name] = error
        problems.append(f"sink {name}: {error}")
    result["problems"] = problems
    return result
