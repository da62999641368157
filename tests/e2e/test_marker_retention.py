"""Marker retention end to end (PROTOCOL.md "Retention and growth"): real processes, the real
stores. The participants' sweep has every sink forget decided parts' markers below the bound
(``participant.keep_decided_txns`` under the last decided transaction, never a pending commit),
so the markers stay bounded while ``twophase status`` still reads each sink's last committed
transaction and positions from what is kept, and the data stays exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from pymongo import MongoClient

from harness import Cluster, Scenario, end_offsets, produce, wait_until
from tests.e2e.e2e_support import caught_up, metric, scenario, scrape, settle, start

KEEP = 5
ROUNDS = 24
PER_ROUND = 40
#: What a sink may hold once forgetting has caught up: the KEEP newest decided transactions'
#: markers (one per participant that wrote in each, two here), one per source partition (its
#: highest position, kept whatever its txn), and the newest committed transaction's. A few more
#: for the commits decided since the last sweep.
MAX_KEPT = 2 * KEEP + 2 + 2 + 4


def _marker_counts(s: Scenario) -> dict[str, int]:
    import psycopg

    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM twophase_parts WHERE pipeline = %s", (s.name,)
        ).fetchone()
    client: MongoClient[dict[str, Any]] = MongoClient(s.mongo_uri)
    try:
        mongo = client[s.table]["twophase_parts"].count_documents(
            {"pipeline": s.name, "kind": "part"}
        )
    finally:
        client.close()
    manifests = s.files_path / "_twophase" / s.name / "manifests"
    files = len(list(manifests.glob("*.json"))) if manifests.exists() else 0
    return {"pg": int(row[0]) if row else 0, "mongo": mongo, "files": files}


def test_sweeps_forget_old_markers_and_keep_what_status_and_recovery_need(
    tmp_path: Path,
) -> None:
    s = scenario(
        tmp_path,
        "retain",
        interval_ms=300,
        partitions=2,
        extra={"participant": {"sweep_interval_ms": 1000, "keep_decided_txns": KEEP}},
    )
    c = Cluster(s)
    start(c, "coordinator", "coord-0")
    json_logs = {"TWOPHASE_LOG_FORMAT": "json"}
    ports = {name: start(c, "participant", name, json_logs) for name in ("p-0", "p-1")}
    high = {0: 0, 1: 0}
    try:
        # Trickle records in, each batch committed before the next: every round is at least
        # one commit that leaves markers in every sink (an idle part writes none).
        for r in range(ROUNDS):
            produce(s.bootstrap, s.topic, r * PER_ROUND, PER_ROUND)
            wait_until(lambda: caught_up(s), 120, f"round {r} to be committed")
        n = ROUNDS * PER_ROUND
        report = settle(s, c, set(range(n)), 120)
        high = end_offsets(s.bootstrap, s.topic, s.partitions)
        # A few more sweeps after the last commit (the idle cycles go on deciding).
        wait_until(
            lambda: max(_marker_counts(s).values()) <= MAX_KEPT, 60, "old markers to be forgotten"
        )
        counts = _marker_counts(s)
        status = subprocess.run(
            [sys.executable, "-m", "twophase.cli.main", "status", str(s.config_path), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        forgotten = {
            sink: sum(
                metric(scrape(port), "twophase_markers_forgotten_total", sink=sink)
                for port in ports.values()
            )
            for sink in ("pg", "mongo", "files")
        }
    finally:
        c.stop_all()
    for sink, rep in report.items():
        assert rep.ok and rep.distinct == n, f"{sink}: {rep}"
    print(counts, forgotten)
    assert status.returncode == 0, status.stdout + status.stderr
    st = json.loads(status.stdout)
    # Not vacuous: far more commits left markers than are kept, and the sweeps deleted them.
    assert st["last_decided"] >= ROUNDS
    for sink in ("pg", "mongo", "files"):
        assert 1 <= counts[sink] <= MAX_KEPT, counts
        assert forgotten[sink] >= ROUNDS - MAX_KEPT, forgotten
    sinks = {e["name"]: e for e in st["sinks"]}
    assert set(sinks) == {"pg", "mongo", "files"}, st["sinks"]
    for name, entry in sinks.items():
        assert "error" not in entry, entry
        # The newest committed markers survive: the last committed txn is a recent one.
        last = entry["last_committed_txn"]
        assert last is not None and last >= ROUNDS, entry
        assert last <= st["last_decided"], entry
        # And so does each partition's highest position: everything produced.
        got = {e["partition"]: e["offset"] for e in entry["committed_positions"]}
        assert got == high, (name, got, high)
        assert entry["behind_log"] == [], entry
    # Each forget is logged with the structured fields of a line about transactions: the
    # newest one forgotten, every source partition, and the sink.
    records = [
        json.loads(line)
        for name in ports
        for line in (c.logs / f"{name}.log").read_text().splitlines()
        if "forgot" in line
    ]
    ours = [r for r in records if "markers of decided parts up to txn" in r["msg"]]
    assert {r["sink"] for r in ours} == {"pg", "mongo", "files"}, records[-5:]
    both = [f"{s.topic}[0]", f"{s.topic}[1]"]
    for r in records:  # the sinks' own lines carry them too
        assert r["txn"] >= 1 and r["partitions"] == both and r["sink"], r
