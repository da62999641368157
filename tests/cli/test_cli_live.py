"""Every operator command against a running pipeline on the real stack.

The coordinator and the participant run as processes started with ``twophase coordinator run``
and ``twophase participant run`` (the harness), so those two commands are exercised here too.
What the CLI reports is checked against Kafka, PostgreSQL and ``control-topic/topics.yaml``
read directly.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import yaml
from confluent_kafka import Consumer, KafkaError, TopicPartition

from harness import Scenario, end_offsets, group_offsets
from tests.cli.conftest import LivePipeline, pg_gids, prepare_pg_part, run_cli, run_json
from twophase.protocol.codec import DecodeError, decode
from twophase.protocol.messages import Decision, Outcome

TOPICS_YAML = Path(__file__).resolve().parents[2] / "control-topic" / "topics.yaml"

STATUS_KEYS = {
    "pipeline",
    "healthy",
    "problems",
    "warnings",
    "leader",
    "leader_host",
    "last_coordinator",
    "last_txn",
    "last_decided",
    "in_flight",
    "last_commit_txn",
    "last_commit_age_s",
    "pending_commits",
    "unapplied_s",
    "total_lag",
    "partitions",
    "participants",
    "sinks",
}


def _positions(entries: list[dict[str, Any]]) -> dict[int, int]:
    return {e["partition"]: e["offset"] for e in entries}


def _last_commits_by_sink(s: Scenario) -> dict[str, tuple[int, str, int]]:
    """Per sink: (txn, participant, decision time in ms) of the last commit DECISION in the
    control log up to its current end with a part prepared in that sink -- read with a plain
    consumer, not with the code under test. Idle cycles commit too, but their parts name no
    sink, so the cycles the live pipeline runs while this reads change nothing."""
    consumer = Consumer(
        {
            "bootstrap.servers": s.bootstrap,
            "group.id": "twophase-test-last-commits",
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "enable.auto.commit": False,
        }
    )
    control = TopicPartition(f"twophase.control.{s.name}", 0, 0)
    consumer.assign([control])
    # Everything below the end offset taken now; its last offset may be a transaction marker,
    # never delivered, so the first message at or past it, or the end of the log, ends the read.
    end = consumer.get_watermark_offsets(control, timeout=30)[1]
    last: dict[str, tuple[int, str, int]] = {}
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            m = consumer.poll(1)
            if m is None:
                continue
            if m.error() is not None:
                if m.error().code() == KafkaError._PARTITION_EOF:
                    return last
                continue
            if m.offset() >= end:
                return last
            raw = m.headers()
            headers = [(k, v) for k, v in raw if isinstance(v, bytes)] if raw else []
            try:
                env = decode(m.value(), headers, key=s.hmac_key.encode())
            except DecodeError:
                continue
            d = env.payload
            if isinstance(d, Decision) and d.outcome is Outcome.COMMIT:
                for part in d.parts:
                    for sink in part.sinks:
                        if d.txn > last.get(sink, (-1, "", 0))[0]:
                            last[sink] = (d.txn, part.participant, env.ts_ms)
            if m.offset() == end - 1:
                return last
    finally:
        consumer.close()
    raise AssertionError("the control log was not read to its end in 60 s")


def test_status_json_shape_and_values(live: LivePipeline) -> None:
    s = live.s
    st = run_json("status", live.config)
    assert set(st) == STATUS_KEYS
    assert st["healthy"] is True, st["problems"]
    assert st["leader"] and st["last_coordinator"] == "coordinator:c-0"
    assert st["last_commit_txn"] is not None and st["last_commit_txn"] <= st["last_decided"]
    committed = group_offsets(s.bootstrap, f"twophase.{s.name}", s.topic, s.partitions)
    ends = end_offsets(s.bootstrap, s.topic, s.partitions)
    assert sum(ends.values()) == live.produced
    assert st["total_lag"] == 0
    assert [
        (p["topic"], p["partition"], p["committed"], p["end"], p["lag"], p["owner"])
        for p in st["partitions"]
    ] == [(s.topic, i, committed[i], ends[i], 0, "p-0") for i in range(s.partitions)]
    # Owners by participant id (from client.id twophase-<pipeline>-participant-<id>).
    [member] = st["participants"]
    assert member["id"] == "p-0"
    assert member["client_id"] == f"twophase-{s.name}-participant-p-0"
    assert [p["partition"] for p in member["partitions"]] == list(range(s.partitions))
    assert member["lag"] == 0
    # Each sink's committed positions: stored with its data, equal to the group's offsets.
    sinks = {e["name"]: e for e in st["sinks"]}
    assert set(sinks) == {"pg", "files"}
    # Each sink's last committed transaction, from its markers: the pipeline is quiet (every
    # record committed and applied), so it is the log's last commit decision naming the sink.
    logged = _last_commits_by_sink(s)
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        row = conn.execute("SHOW track_commit_timestamp").fetchone()
    pg_times = row is not None and row[0] == "on"
    read_at = datetime.now(UTC)
    for name, entry in sinks.items():
        assert "error" not in entry, entry
        assert entry["type"] == {"pg": "postgres", "files": "files"}[name]
        assert _positions(entry["committed_positions"]) == committed, name
        assert entry["behind_log"] == []
        assert "note" not in entry, entry  # both built-in sinks report their last commit
        txn, participant, decided_ms = logged[name]
        assert (entry["last_committed_txn"], entry["last_committed_by"]) == (txn, "p-0"), name
        assert participant == "p-0"
        if name == "pg" and not pg_times:  # COMMIT PREPARED leaves no time but the server's
            assert entry["committed_at"] is None and entry["committed_age_s"] is None
            continue
        # Committed after the decision was written (same host's clock; ms rounding aside).
        at = datetime.fromisoformat(entry["committed_at"])
        decided = datetime.fromtimestamp(decided_ms / 1000, UTC)
        assert decided - timedelta(seconds=1) <= at <= read_at, (name, at, decided)
        assert 0 <= entry["committed_age_s"] <= (read_at - decided).total_seconds() + 2, name

    human = run_cli("status", live.config)
    assert human.exit_code == 0, human.output
    assert "(healthy)" in human.stdout and "p-0" in human.stdout
    assert f"{s.topic}[0]={committed[0]}" in human.stdout

    quick = run_json("status", live.config, "--no-sinks")
    assert quick["sinks"] is None and quick["healthy"] is True


def test_topics_create_and_describe_show_the_topics_yaml_settings(live: LivePipeline) -> None:
    s = live.s
    created = run_json("topics", "create", live.config)
    control, dlq = f"twophase.control.{s.name}", f"{s.name}.dlq"
    reply = f"{control}.replies"
    assert created == {control: "exists", reply: "exists", dlq: "exists", s.topic: "exists"}

    want = yaml.safe_load(TOPICS_YAML.read_text())
    described = run_json("topics", "describe", live.config)
    assert described["problems"] == []
    topics = {t["topic"]: t for t in described["topics"]}
    assert [topics[n]["role"] for n in (control, reply, dlq, s.topic)] == [
        "control",
        "reply",
        "dead_letter",
        "source",
    ]
    brokers = described["brokers"]
    # The reply topic is made like the control topic.
    for name, section in ((control, "control"), (reply, "control"), (dlq, "dead_letter")):
        t = topics[name]
        conf = {k: str(v) for k, v in want[section]["config"].items()}
        assert t["partitions"] == want[section]["partitions"]
        assert t["replication_factor"] == min(want[section]["replication_factor"], brokers)
        for key in ("cleanup.policy", "retention.ms"):
            assert t["config"][key] == conf[key], (name, key)
        # Clamped to replication - 1 (>= 1), as `topics create` does.
        rf = t["replication_factor"]
        assert t["config"]["min.insync.replicas"] == str(
            max(1, min(int(conf["min.insync.replicas"]), rf - 1 or 1))
        )
        assert t["drift"] == {}
    assert topics[control]["config"]["max.message.bytes"] == str(
        want["control"]["config"]["max.message.bytes"]
    )
    assert topics[control]["config"]["unclean.leader.election.enable"] == "false"
    source = topics[s.topic]
    assert source["partitions"] == s.partitions
    ends = end_offsets(s.bootstrap, s.topic, s.partitions)
    assert {o["partition"]: o["end"] for o in source["offsets"]} == ends
    assert topics[control]["offsets"][0]["end"] > 0  # the live pipeline's cycles
    assert topics[reply]["offsets"][0]["end"] > 0  # and its votes and APPLIED

    human = run_cli("topics", "describe", live.config)
    assert human.exit_code == 0
    assert f"retention.ms = {want['control']['config']['retention.ms']}" in human.stdout


def test_validate_on_the_live_config(live: LivePipeline) -> None:
    ok = run_cli("validate", live.config)
    assert ok.exit_code == 0 and "ok (pipeline" in ok.stdout


def test_txn_show_of_a_committed_transaction(live: LivePipeline) -> None:
    last = run_json("status", live.config, "--no-sinks")["last_decided"]
    shown = run_json("txn", "show", live.config, str(last))
    log = shown["log"]
    assert log["prepare"] is not None and log["prepare"]["sender"] == "coordinator:c-0"
    assert [v["participant"] for v in log["votes"]] == ["p-0"]
    assert log["decision"]["outcome"] == "commit", log["decision"]
    assert log["decision"]["positions"], "a commit decision carries every position"
    assert [p["participant"] for p in shown["parts"]] == ["p-0"]
    assert shown["parts"][0]["outcome"] == "commit"
    assert set(shown["parts"][0]["sinks"]) == {"pg", "files"}

    # The same transaction as text; read from the beginning, since the live pipeline may have
    # written a checkpoint past it meanwhile (the tail would then start after it: seen in CI).
    human = run_cli("txn", "show", live.config, str(last), "--from-beginning")
    assert human.exit_code == 0
    for word in ("PREPARE", "VOTE", "DECISION", "p-0"):
        assert word in human.stdout

    old = run_cli("txn", "show", live.config, "1", "--from-beginning")
    assert (
        old.exit_code == 0 and "PREPARE" in old.stdout and "read from the beginning" in old.stdout
    )


def test_txn_list_finds_a_dead_participants_prepared_part_and_resolve_aborts_it(
    live: LivePipeline,
) -> None:
    s, cfg = live.s, live.cfg
    listing = run_json("txn", "list", live.config)
    # The live participant's own parts may show up while their decision is being applied.
    assert {r["participant"] for r in listing["parts"]} <= {"p-0"}, listing
    txn = listing["last_decided"] - 1  # decided long ago, and no decision names p-gone
    prepare_pg_part(cfg, s, txn, "p-gone", [900_001, 900_002])
    gid = f"twophase:pg:{s.name}~{txn:012d}~p-gone"
    assert gid in pg_gids(s)

    listing = run_json("txn", "list", live.config)
    [row] = [r for r in listing["parts"] if r["participant"] == "p-gone"]
    assert row["txn"] == txn and row["prepared_in"] == ["pg"]
    assert row["outcome"] == "abort" and row["owner"] == "gone"

    refused = run_json(
        "txn", "resolve", live.config, str(txn), "-p", "p-gone", "--commit", exit_code=3
    )
    assert refused["logged"] == "abort"
    done = run_json("txn", "resolve", live.config, str(txn), "-p", "p-gone", "--abort")
    assert done["ok"] and done["sinks"] == {"pg": "aborted", "files": "not prepared here"}
    assert gid not in pg_gids(s)
    # The pipeline did not notice: it keeps committing.
    assert run_json("status", live.config, "--no-sinks")["healthy"] is True


def test_an_unreachable_sink_is_a_warning_for_status_and_an_error_for_txn_list(
    live: LivePipeline, tmp_path: Path
) -> None:
    raw = yaml.safe_load(Path(live.config).read_text())
    # A port nothing listens on: connection refused at once.
    raw["sinks"][0]["dsn"] = "postgresql://twophase:twophase@127.0.0.1:1/twophase"
    broken = tmp_path / "unreachable-pg.yaml"
    broken.write_text(yaml.safe_dump(raw))

    st = run_json("status", str(broken))
    assert st["healthy"] is True  # health is the log's and Kafka's
    [pg] = [e for e in st["sinks"] if e["name"] == "pg"]
    assert "error" in pg and any(w.startswith("sink pg:") for w in st["warnings"])
    assert [e["name"] for e in st["sinks"] if "error" not in e] == ["files"]

    listing = run_json("txn", "list", str(broken), exit_code=1)
    assert set(listing["sink_errors"]) == {"pg"}
