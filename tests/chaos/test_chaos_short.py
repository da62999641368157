"""The short chaos run (``python -m chaos.run --short``) on the real stack, in every ``make test``.

A few kill -9 faults -- a participant at a named crash point, a participant at a random time, the
leading coordinator -- and two network faults through Toxiproxy (a participant cut from
PostgreSQL, one cut from MongoDB half-way through a chunked commit, or from Kafka when the stack's
broker has the per-process listeners) on ~20k records flowing into PostgreSQL, MongoDB and
Parquet files, then an independent check of every sink (``harness.verify``). ``make chaos`` is
the long run.
"""

from __future__ import annotations

import json
from pathlib import Path

from chaos.run import main


def test_short_chaos_run_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    rc = main(["--short", "--seed", "7", "--workdir", str(tmp_path / "run"), "--out", str(out)])
    summary = json.loads(out.read_text())
    assert summary["records"] == 20_000
    assert set(summary["sinks"]) == {"pg", "mongo", "files"}
    for sink, counts in summary["sinks"].items():
        for what in ("lost", "duplicated", "orphaned_prepared", "staging_leftovers"):
            assert counts[what] == 0, f"{sink}: {what} = {counts[what]} ({summary['workdir']})"
    assert summary["offsets_caught_up"], summary["failures"]
    mix = summary["fault_mix"]
    assert any(k.startswith("participant:crash_point:") for k in mix), mix
    assert mix.get("coordinator:sigkill:leader", 0) >= 1, mix
    assert summary["faults"] >= 3, mix
    net = summary["network_fault_mix"]
    assert net.get("participant:partition:pg", 0) == 1, net
    assert summary["network_faults"] == 2, net
    assert summary["fault_kinds"].get("partition", 0) == 2, summary["fault_kinds"]
    for episode in summary["episode_log"]:
        assert "recovery_s" in episode and not episode.get("skipped"), episode
    assert not summary["unexpected_exits"], summary["unexpected_exits"]
    assert rc == 0, summary["failures"]
