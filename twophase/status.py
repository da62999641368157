"""``twophase status`` and ``twophase topics describe``: what the control log, Kafka and the
sinks say about a pipeline, without asking any running process (so they work when those are
down, which is when they are needed most)."""

from __future__ import annotations

import time
from contextlib import suppress
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

# Public, but re-exported there without __all__, which mypy --strict treats as private.
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType  # type: ignore[attr-defined]

from participants.sdk import Sink, SinkError
from twophase.config import PipelineConfig
from twophase.errors import RetriableError
from twophase.kafka import CALL_TIMEOUT_S, client_settings
from twophase.protocol.topics import topic_settings
from twophase.txn import Progress, fold_log, open_sinks

__all__ = ["describe_topics", "pipeline_status"]

#: Topic settings ``topics describe`` shows: the ones the protocol depends on (PROTOCOL.md).
KEY_TOPIC_CONFIGS = (
    "cleanup.policy",
    "retention.ms",
    "min.insync.replicas",
    "max.message.bytes",
    "unclean.leader.election.enable",
)

#: What ``status`` says of a sink (a plugin) that does not implement ``Sink.last_committed``.
NO_LAST_COMMITTED = "this sink type does not report its last committed transaction"


def _quiet(_note: str) -> None:
    pass


def _members(cfg: PipelineConfig, group: str) -> list[Any] | None:
    """The group's members (confluent-kafka ``MemberDescription``), None when it can't be described."""
    admin = AdminClient(client_settings(cfg, "admin"))
    try:
        desc = admin.describe_consumer_groups([group])[group].result(timeout=CALL_TIMEOUT_S)
    except KafkaException:
        return None
    return list(desc.members)


def _assigned(member: Any) -> list[tuple[str, int]]:
    tps = member.assignment.topic_partitions if member.assignment else []
    return sorted((tp.topic, tp.partition) for tp in tps)


def _participant_id(cfg: PipelineConfig, client_id: str) -> str:
    prefix = f"twophase-{cfg.pipeline}-participant-"
    return client_id[len(prefix) :] if client_id.startswith(prefix) else client_id


#: Status reports a sink it cannot reach rather than waiting for it: a probe must answer quickly.
SINK_RETRY_S = 5.0


def _sinks_status(cfg: PipelineConfig, log_positions: dict[tuple[str, int], int]) -> list[Any]:
    sinks, errors = open_sinks(cfg, retry_s=SINK_RETRY_S)
    out: list[dict[str, Any]] = []
    try:
        for sink in sinks:
            entry: dict[str, Any] = {"name": sink.name, "type": sink.config.type}
            reports = type(sink).last_committed is not Sink.last_committed
            try:
                positions = sink.committed_positions()
                last = sink.last_committed() if reports else None
            except SinkError as exc:
                entry["error"] = str(exc)
                out.append(entry)
                continue
            # The newest committed part in the store, from its own markers: equal to the log's
            # last commit decision naming this sink once that decision is applied.
            at = last.committed_at if last is not None else None
            entry["last_committed_txn"] = last.txn if last is not None else None
            entry["last_committed_by"] = last.part.participant if last is not None else None
            entry["committed_at"] = at.isoformat(timespec="milliseconds") if at else None
            entry["committed_age_s"] = round(time.time() - at.timestamp(), 1) if at else None
            if not reports:
                entry["note"] = NO_LAST_COMMITTED
            entry["committed_positions"] = [
                {"topic": t, "partition": p, "offset": o} for (t, p), o in sorted(positions.items())
            ]
            # Normal while a decision is being applied; lasting, it means the sink is stuck.
            entry["behind_log"] = [
                {"topic": t, "partition": p, "sink": o, "log": log_positions[(t, p)]}
                for (t, p), o in sorted(positions.items())
                if o < log_positions.get((t, p), -1)
            ]
            out.append(entry)
    finally:
        for sink in sinks:
            with suppress(SinkError):  # status is read-only; a failed close loses nothing
                sink.close()
    for name, error in errors.items():
        out.append({"name": name, "error": error})
    return sorted(out, key=lambda e: str(e["name"]))


def pipeline_status(
    cfg: PipelineConfig,
    *,
    max_commit_age_s: float,
    sinks: bool = True,
    progress: Progress = _quiet,
) -> dict[str, Any]:
    """Health from the control log and Kafka; each sink's last committed transaction and
    committed positions when ``sinks``.

    Health depends on the log and Kafka only: a sink that cannot be read is a warning (the
    reader may lack the participants' volumes or network, e.g. a ``helm test`` pod).
    """
    fold = fold_log(cfg, progress=progress)
    view = fold.view
    progress("reading source offsets")
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
    progress("describing the consumer groups")
    members = _members(cfg, cfg.group_id)
    owners: dict[tuple[str, int], str] = {}
    participants: list[dict[str, Any]] = []
    for m in members or []:
        pid = _participant_id(cfg, m.client_id or m.member_id)
        for tp in _assigned(m):
            owners[tp] = pid
        participants.append(
            {"id": pid, "client_id": m.client_id, "host": m.host, "partitions": [], "lag": 0}
        )
    leader_members = _members(cfg, cfg.coordinator_group_id) or []
    leader = next(
        (m for m in leader_members if (cfg.control_topic, 0) in _assigned(m)),
        None,
    )
    partitions: list[dict[str, Any]] = []
    total_lag = 0
    by_id = {p["id"]: p for p in participants}
    warnings: list[str] = []
    now_ms = time.time() * 1000
    for (t, p), end in sorted(ends.items()):
        pos = committed.get((t, p), -1)
        lag = end - pos if pos >= 0 else end
        total_lag += lag
        owner = owners.get((t, p))
        # How long the records have waited behind a position no commit moved, as far as the
        # log read tells ("at least" when the last move is older than the checkpoint). After a
        # long idle spell this reads high until the next commit moves it (one cycle).
        moved = fold.moved_at.get((t, p))
        since = moved or fold.first_ts
        unmoved = round((now_ms - since) / 1000, 1) if lag > 0 and since else None
        partitions.append(
            {
                "topic": t,
                "partition": p,
                "committed": pos,
                "end": end,
                "lag": lag,
                "owner": owner,
                "unmoved_s": unmoved,
            }
        )
        if unmoved is not None and unmoved >= cfg.commit.stall_alarm_s:
            warnings.append(
                f"{t}[{p}]: {lag} records waiting and no commit has moved its position for "
                f"{'at least ' if moved is None else ''}{unmoved:.0f}s "
                f"(commit.stall_alarm_s {cfg.commit.stall_alarm_s:.0f}): is a participant stuck?"
            )
        if owner in by_id:
            by_id[owner]["partitions"].append({"topic": t, "partition": p, "lag": lag})
            by_id[owner]["lag"] += lag
    age = round(time.time() - fold.last_commit_ts / 1000, 1) if fold.last_commit_ts else None
    problems: list[str] = []
    if leader is None:
        problems.append("no coordinator owns the control partition")
    if not owners:
        problems.append("no participant holds any source partition")
    if total_lag and (age is None or age > max_commit_age_s):
        problems.append(
            f"records are waiting and the last commit is {age}s old (limit {max_commit_age_s}s)"
        )
    sink_entries: list[dict[str, Any]] | None = None
    if sinks:
        progress("reading the sinks' last commits and positions")
        sink_entries = _sinks_status(cfg, view.positions)
        warnings += [f"sink {e['name']}: {e['error']}" for e in sink_entries if "error" in e]
    return {
        "pipeline": cfg.pipeline,
        "healthy": not problems,
        "problems": problems,
        "warnings": warnings,
        "leader": leader.client_id if leader is not None else None,
        "leader_host": leader.host if leader is not None else None,
        "last_coordinator": fold.last_coordinator,
        "last_txn": view.last_txn,
        "last_decided": view.last_decided,
        "in_flight": sorted(view.undecided),
        "last_commit_txn": fold.last_commit.txn if fold.last_commit else None,
        "last_commit_age_s": age,
        "pending_commits": sorted(view.pending),
        "total_lag": total_lag,
        "partitions": partitions,
        "participants": sorted(participants, key=lambda p: str(p["id"])),
        "sinks": sink_entries,
    }


# -- topics describe -----------------------------------------------------------------------------


def _expected(cfg: PipelineConfig, brokers: int) -> dict[str, tuple[str, int, int, dict[str, str]]]:
    """What ``topics create`` would make of each topic on this cluster (same clamping)."""
    out: dict[str, tuple[str, int, int, dict[str, str]]] = {}
    roles = ["control", "dead_letter"] + ["source"] * len(cfg.sources)
    for role, (name, partitions, rf, conf) in zip(roles, topic_settings(cfg), strict=True):
        rf = max(1, min(rf, brokers))
        conf = dict(conf)
        if "min.insync.replicas" in conf:
            conf["min.insync.replicas"] = str(
                max(1, min(int(conf["min.insync.replicas"]), rf - 1 or 1))
            )
        out[name] = (role, partitions, rf, conf)
    return out


def describe_topics(cfg: PipelineConfig, *, progress: Progress = _quiet) -> dict[str, Any]:
    """Every topic of the pipeline as the cluster has it, next to what ``topics.yaml`` and the
    config ask for. Problems: a missing topic, a control topic that is not one partition, and
    control-topic settings that differ from the expected ones (the protocol relies on them)."""
    admin = AdminClient(client_settings(cfg, "admin"))
    progress("reading cluster metadata")
    try:
        md = admin.list_topics(timeout=CALL_TIMEOUT_S)
    except KafkaException as exc:
        raise RetriableError(f"Kafka metadata unavailable: {exc.args[0].str()}") from None
    expected = _expected(cfg, len(md.brokers))
    present = [name for name in expected if name in md.topics]
    configs: dict[str, dict[str, Any]] = {}
    if present:
        progress("reading topic configs")
        futures = admin.describe_configs(
            [ConfigResource(ResourceType.TOPIC, name) for name in present]
        )
        for resource, fut in futures.items():
            try:
                configs[resource.name] = fut.result(timeout=CALL_TIMEOUT_S)
            except KafkaException as exc:
                raise RetriableError(
                    f"cannot describe topic {resource.name}: {exc.args[0].str()}"
                ) from None
    progress("reading end offsets")
    probe = Consumer(client_settings(cfg, "describe-consumer", **{"group.id": cfg.group_id}))
    topics: list[dict[str, Any]] = []
    problems: list[str] = []
    try:
        for name, (role, want_partitions, want_rf, want_conf) in expected.items():
            entry: dict[str, Any] = {"topic": name, "role": role}
            meta = md.topics.get(name)
            if meta is None or meta.error is not None:
                entry["exists"] = False
                problems.append(
                    f"topic {name} ({role}) does not exist: run `twophase topics create`"
                )
                topics.append(entry)
                continue
            parts = sorted(meta.partitions.values(), key=lambda p: p.id)
            rf = min((len(p.replicas) for p in parts), default=0)
            actual = {
                k: configs[name][k].value for k in KEY_TOPIC_CONFIGS if k in configs.get(name, {})
            }
            drift = {
                k: {"expected": v, "actual": actual.get(k)}
                for k, v in sorted(want_conf.items())
                if k in KEY_TOPIC_CONFIGS and actual.get(k) != v
            }
            if len(parts) != want_partitions:
                drift["partitions"] = {"expected": want_partitions, "actual": len(parts)}
            if rf != want_rf:
                drift["replication_factor"] = {"expected": want_rf, "actual": rf}
            offsets = []
            for p in parts:
                low, high = probe.get_watermark_offsets(
                    TopicPartition(name, p.id), timeout=CALL_TIMEOUT_S
                )
                offsets.append(
                    {
                        "partition": p.id,
                        "leader": p.leader,
                        "replicas": list(p.replicas),
                        "isr": list(p.isrs),
                        "start": low,
                        "end": high,
                    }
                )
            entry.update(
                {
                    "exists": True,
                    "partitions": len(parts),
                    "replication_factor": rf,
                    "config": actual,
                    "drift": drift,
                    "offsets": offsets,
                }
            )
            if role == "control":
                if len(parts) != 1:
                    problems.append(
                        f"control topic {name} has {len(parts)} partitions; the protocol needs "
                        "exactly 1 (total order of a pipeline's messages)"
                    )
                problems += [
                    f"control topic {name}: {k} is {d['actual']}, expected {d['expected']}"
                    for k, d in drift.items()
                    if k not in ("partitions", "replication_factor")
                ]
            topics.append(entry)
    finally:
        probe.close()
    return {
        "pipeline": cfg.pipeline,
        "brokers": len(md.brokers),
        "topics": topics,
        "problems": problems,
    }
