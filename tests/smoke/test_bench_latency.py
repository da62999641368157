"""The commit-latency bench (:mod:`bench.latency`) on the stack: once the group has settled,
the next cycle is timed apart as the warm-up and the ``cycles`` after it are the measured ones
-- with 20 cycles a p99 is the slowest cycle, and that one is a start-up cycle (the first parts
with records, the sinks' first writes and prepares)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import latency as lat

pytestmark = [pytest.mark.stack]


def test_the_warm_up_cycle_is_timed_apart_from_the_measured_ones(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    run = lat.latency_run(kafka_bootstrap, tmp_path, 2, cycles=3)
    out = run.asdict()
    assert len(out["warmup_ms"]) == 1, out
    assert out["cycles"] == 3 and len(run.cycles) == 3, out
    # The warm-up is the cycle right before the measured ones, and not one of them.
    assert len(run.warmup_txns) == 1 and len(run.txns) == 3, (run.warmup_txns, run.txns)
    assert run.warmup_txns[0] not in run.txns, (run.warmup_txns, run.txns)
    assert run.txns == sorted(run.txns) and run.warmup_txns[0] < run.txns[0], run.txns
    assert out["aborted"] == 0, out
    # Every measured cycle has its phases (the warm-up's are not among them).
    assert all(len(v) == 3 for v in run.phases.values()), run.phases
    assert all(ms > 0 for ms in out["warmup_ms"] + run.cycles), out
