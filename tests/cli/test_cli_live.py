"""Every operator command against a running pipeline on the real stack.

The coordinator and the participant run as processes started with ``twophase coordinator run``
and ``twophase participant run`` (the harness), so those two commands are exercised here too.
What the CLI reports is checked against Kafka, PostgreSQL and ``control-topic/topics.yaml``
read directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.cli.conftest import LivePipeline, pg_gids, prepare_pg_part, run_cli, run_json
from twophase.harness import end_offsets, group_offsets

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
    "total_lag",
    "partitions",
    "participants",
    "sinks",
}


def _positions(entries: list[dict[str, Any]]) -> dict[int, int]:
    return {e["partition"]: e["offset"] for e in entries}


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
    for name, entry in sinks.items():
        assert "error" not in entry, entry
        assert entry["type"] == {"pg": "postgres", "files": "files"}[name]
        assert _positions(entry["committed_positions"]) == committed, name
        assert entry["last_committed_txn"] is None and "SDK" in entry["note"]
        assert entry["behind_log"] == []

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
    assert created == {control: "exists", dlq: "exists", s.topic: "exists"}

    want = yaml.safe_load(TOPICS_YAML.read_text())
    described = run_json("topics", "describe", live.config)
    assert described["problems"] == []
    topics = {t["topic"]: t for t in described["topics"]}
    assert [topics[n]["role"] for n in (control, dlq, s.topic)] == [
        "control",
        "dead_letter",
        "source",
    ]
    brokers = described["brokers"]
    for name, section in ((control, "control"), (dlq, "dead_letter")):
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

    human = run_cli("txn", "show", live.config, str(last))
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
