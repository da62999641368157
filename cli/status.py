"""``twophase status`` and ``twophase topics describe``: what the control log, Kafka and the
sinks say about a pipeline, without asking any running process (so they work when those are
down, which is when they are needed most)."""

from __future__ import annotations

import threading
import time
from contextlib import suppress
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

# Public, but re-exported there without __all__, which mypy --strict treats as private.
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType  # type: ignore[attr-defined]

from twophase.cli.txn import CLI_PARTICIPANT, Progress, fold_log
from twophase.config import PipelineConfig
from twophase.errors import RetriableError
from twophase.kafka import CALL_TIMEOUT_S, client_settings
from twophase.participants.registry import build_sinks
from twophase.participants.sdk import Sink, SinkError
from twophase.protocol.topics import topic_settings
from twophase.retry import STATUS_PROBE_RETRY_S, STORE

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


#: The whole probe of every sink (connect, set-up, positions, last commit) ends by then. A
#: store that accepts connections and never answers (a stopped MongoDB server) would otherwise
#: hold `status` for the driver's socket time-out (minutes); a driver call cannot be cut short
#: from outside, so each sink is probed on a thread and left behind past the deadline.
SINK_PROBE_S = 10.0


def _probe_sink(sink: Sink, log_positions: dict[tuple[str, int], int]) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": sink.name, "type": sink.config.type}
    reports = type(sink).last_committed is not Sink.last_committed
    try:
        STORE.call(
            sink.setup,
            f"set-up of sink {sink.name}",
            budget_s=STATUS_PROBE_RETRY_S,
            give_up=RetriableError,
        )
        positions = sink.committed_positions()
        last = sink.last_committed() if reports else None
    except (SinkError, RetriableError) as exc:
        entry["error"] = str(exc)
        return entry
    finally:
        with suppress(SinkError):  # status is read-only; a failed close loses nothing
            sink.close()
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
    return entry


def _sinks_status(
    cfg: PipelineConfig,
    log_positions: dict[tuple[str, int], int],
    deadline_s: float = SINK_PROBE_S,
) -> list[Any]:
    """Every sink probed at once, each on a daemon thread; one that has not answered by
    ``deadline_s`` is reported as such and left behind (the process exits without it)."""
    sinks = build_sinks(
        cfg.sinks, pipeline=cfg.pipeline, participant=CLI_PARTICIPANT, source=cfg.source_file
    )
    results: dict[str, dict[str, Any]] = {}

    def probe(sink: Sink) -> None:
        try:
            results[sink.name] = _probe_sink(sink, log_positions)
        except Exception as exc:  # noqa: BLE001 -- a plugin's bug: reported like any unreadable sink
            results[sink.name] = {"name": sink.name, "error": f"{type(exc).__name__}: {exc}"}

    threads = [
        threading.Thread(target=probe, args=(s,), name=f"probe-{s.name}", daemon=True)
        for s in sinks
    ]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    out = [
        results.get(s.name)
        or {"name": s.name, "error": f"no answer within {deadline_s:.0f}s (is the store up?)"}
        for s in sinks
    ]
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
    # What the tail since the checkpoint cannot tell -- the last commit, when a partition last
    # moved, when a still-pending commit was decided -- is read from the whole retained log,
    # once: otherwise a stall older than the checkpoint reads as a few seconds (seen: healthy
    # for 8 minutes with 63,113 records waiting), and a tail without a commit as no commit.
    history = fold
    progress("reading source offsets")
    probe = Consumer(client_settings(cfg, "status-consumer", **{"group.id": cfg.group_id}))
    try:
        md = probe.list_topics(timeout=CALL_TIMEOUT_S)
        tps = [
            TopicPartition(t, p)
            for t in cfg.resolve_topics(md.topics)
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
    lagging = {tp for tp, end in ends.items() if end - max(committed.get(tp, -1), 0) > 0}
    if fold.read_from == "checkpoint" and (
        fold.last_commit is None
        or any(tp not in fold.moved_at for tp in lagging)
        or any(txn not in fold.decided_at for txn in view.pending)
    ):
        progress("reading the control log from its start (history before the checkpoint)")
        history = fold_log(cfg, from_beginning=True, progress=progress)
    stalled: list[str] = []
    for (t, p), end in sorted(ends.items()):
        pos = committed.get((t, p), -1)
        lag = end - pos if pos >= 0 else end
        total_lag += lag
        owner = owners.get((t, p))
        # How long the records have waited behind a position no commit moved, as far as the
        # log read tells ("at least" when the last move is older than the checkpoint). After a
        # long idle spell this reads high until the next commit moves it (one cycle).
        moved = history.moved_at.get((t, p))
        since = moved or history.first_ts
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
            # What the leading coordinator's stall alarm raises: unhealthy, as it is there.
            stalled.append(
                f"{t}[{p}]: {lag} records waiting and no commit has moved its position for "
                f"{'at least ' if moved is None else ''}{unmoved:.0f}s "
                f"(commit.stall_alarm_s {cfg.commit.stall_alarm_s:.0f}): is a participant stuck?"
            )
        if owner in by_id:
            by_id[owner]["partitions"].append({"topic": t, "partition": p, "lag": lag})
            by_id[owner]["lag"] += lag
    last_commit, last_commit_ts = (
        (fold.last_commit, fold.last_commit_ts)
        if fold.last_commit is not None
        else (history.last_commit, history.last_commit_ts)
    )
    age = round(time.time() - last_commit_ts / 1000, 1) if last_commit_ts else None
    problems: list[str] = []
    if leader is None:
        problems.append("no coordinator owns the control partition")
    if not owners:
        problems.append("no participant holds any source partition")
    if total_lag and age is None:
        problems.append("records are waiting and the retained control log holds no commit")
    elif total_lag and age is not None and age > max_commit_age_s:
        problems.append(
            f"records are waiting and the last commit is {age}s old (limit {max_commit_age_s}s)"
        )
    problems += stalled
    # A commit decided and not applied by every part: its records are in no sink yet.
    unapplied = {
        txn: round((now_ms - at) / 1000, 1)
        for txn in view.pending
        if (at := fold.decided_at.get(txn) or history.decided_at.get(txn) or history.first_ts)
    }
    late = {txn: s for txn, s in unapplied.items() if s > max_commit_age_s}
    if late:
        oldest = min(late)
        problems.append(
            f"{len(late)} commit(s) decided more than {max_commit_age_s}s ago and not applied "
            f"by every participant (oldest: txn {oldest}, {late[oldest]:.0f}s): "
            "is a participant or a sink stuck? (`twophase txn list`)"
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
        "last_commit_txn": last_commit.txn if last_commit else None,
        "last_commit_age_s": age,
        "pending_commits": sorted(view.pending),
        "unapplied_s": {str(txn): s for txn, s in sorted(unapplied.items())},
        "total_lag": total_lag,
        "partitions": partitions,
        "participants": sorted(participants, key=lambda p: str(p["id"])),
        "sinks": sink_entries,
    }


# -- topics describe -----------------------------------------------------------------------------


def _expected(cfg: PipelineConfig, brokers: int) -> dict[str, tuple[str, int, int, dict[str, str]]]:
    """What ``topics create`` would make of each topic on this cluster (same clamping)."""
    out: dict[str, tuple[str, int, int, dict[str, str]]] = {}
    roles = ["control", "reply", "dead_letter"] + ["source"] * len(cfg.sources)
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
                if role == "reply":
                    # Not a fault: the replies go to the control topic, as before it existed.
                    entry["note"] = (
                        "votes and APPLIED go to the control topic, which every participant "
                        "reads; `twophase topics create` makes it"
                    )
                else:
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
