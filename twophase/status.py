"""``twophase status``: what the control log and Kafka say about a pipeline, without asking any
running process (so it works when they are down, which is when it is needed most)."""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from twophase.config import PipelineConfig
from twophase.kafka import CALL_TIMEOUT_S, ControlReader, client_settings
from twophase.protocol.logview import LogView
from twophase.protocol.messages import Decision, Outcome

__all__ = ["pipeline_status"]


def _owners(cfg: PipelineConfig, group: str) -> dict[tuple[str, int], str]:
    admin = AdminClient(client_settings(cfg, "admin"))
    owners: dict[tuple[str, int], str] = {}
    try:
        desc = admin.describe_consumer_groups([group])[group].result(timeout=CALL_TIMEOUT_S)
    except KafkaException:
        return owners
    for member in desc.members:
        assignment = member.assignment.topic_partitions if member.assignment else []
        for tp in assignment:
            owners[(tp.topic, tp.partition)] = member.client_id or member.member_id
    return owners


def pipeline_status(cfg: PipelineConfig, *, max_commit_age_s: float) -> dict[str, Any]:
    view = LogView()
    last_commit: Decision | None = None
    last_commit_ts = 0
    reader = ControlReader(cfg)
    try:
        for env in reader.replay():
            view.apply(env)
            if isinstance(env.payload, Decision) and env.payload.outcome is Outcome.COMMIT:
                last_commit, last_commit_ts = env.payload, env.ts_ms
    finally:
        reader.close()
    probe = Consumer(client_settings(cfg, "status-consumer", **{"group.id": cfg.group_id}))
    try:
        md = probe.list_topics(timeout=CALL_TIMEOUT_S)
        tps = [
            TopicPartition(t, p)
            for t in cfg.source_topics
            if t in md.topics
            for p in sorted(md.topics[t].partitions)
        ]
        committed = {
            (c.topic, c.partition): c.offset for c in probe.committed(tps, timeout=CALL_TIMEOUT_S)
        }
        ends = {
            (tp.topic, tp.partition): probe.get_watermark_offsets(tp, timeout=CALL_TIMEOUT_S)[1]
            for tp in tps
        }
    finally:
        probe.close()
    owners = _owners(cfg, cfg.group_id)
    leaders = _owners(cfg, cfg.coordinator_group_id)
    partitions: list[dict[str, Any]] = []
    total_lag = 0
    for (t, p), end in sorted(ends.items()):
        pos = committed.get((t, p), -1)
        lag = end - pos if pos >= 0 else end
        total_lag += lag
        partitions.append(
            {
                "topic": t,
                "partition": p,
                "committed": pos,
                "end": end,
                "lag": lag,
                "owner": owners.get((t, p)),
            }
        )
    age = round(time.time() - last_commit_ts / 1000, 1) if last_commit_ts else None
    problems: list[str] = []
    leader = leaders.get((cfg.control_topic, 0))
    if leader is None:
        problems.append("no coordinator owns the control partition")
    if not owners:
        problems.append("no participant holds any source partition")
    if total_lag and (age is None or age > max_commit_age_s):
        problems.append(
            f"records are waiting and the last commit is {age}s old (limit {max_commit_age_s}s)"
        )
    return {
        "pipeline": cfg.pipeline,
        "healthy": not problems,
        "problems": problems,
        "leader": leader,
        "last_txn": view.last_txn,
        "last_decided": view.last_decided,
        "in_flight": sorted(view.undecided),
        "last_commit_txn": last_commit.txn if last_commit else None,
        "last_commit_age_s": age,
        "pending_commits": sorted(view.pending),
        "total_lag": total_lag,
        "partitions": partitions,
    }
