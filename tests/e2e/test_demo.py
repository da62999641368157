"""`make demo` end to end, through the same code, at a smaller size: the front door must not break
without this test failing.

Both halves run as `make demo` runs them (`python -m harness.demo`, `python -m harness.spark_demo`) on
the local stack, with their crashes: a participant killed right after its 3rd vote, and the Spark
writer's driver killed with every part of a batch prepared. Only the record counts are smaller.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.stack, pytest.mark.slow]

# Enough records to span several commit cycles (the crash is at the 3rd vote) at SecantusDB's
# ~1,000 writes/s; `make demo` uses 50,000.
DEMO_RECORDS = 5_000
# make demo's Spark half uses 3,000 events; 800 still gives four micro-batches.
SPARK_EVENTS = 800
# A participant killed inside its MongoDB commit blocks that store for the transaction lifetime
# (60 s, as on mongod; stack/README.md), then everything is verified; the rest is a busy machine.
DEMO_TIMEOUT_S = 420
# Two Spark runs (job + writer, the writer started twice) on local[2].
SPARK_TIMEOUT_S = 480

ROW = re.compile(r"^\s*(\w+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s*$")


def _run(args: list[str], timeout_s: float, workdir: Path) -> tuple[str, float]:
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", *args, "--workdir", str(workdir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    elapsed = time.monotonic() - started
    assert run.returncode == 0, (
        f"{' '.join(args)} exited {run.returncode} after {elapsed:.0f}s\n"
        f"--- stdout\n{run.stdout[-6000:]}\n--- stderr\n{run.stderr[-4000:]}"
    )
    return run.stdout, elapsed


def _table(out: str, header: str) -> dict[str, tuple[int, ...]]:
    """The verification table after ``header``: sink -> its six counts."""
    lines = out[out.index(header) :].splitlines()[1:]
    rows: dict[str, tuple[int, ...]] = {}
    for line in lines:
        m = ROW.match(line)
        if not m:
            break
        rows[m.group(1)] = tuple(int(g) for g in m.groups()[1:])
    return rows


@pytest.mark.timeout(DEMO_TIMEOUT_S + 60)
def test_twophase_demo_with_its_crash(tmp_path: Path) -> None:
    out, elapsed = _run(["harness.demo", "--records", str(DEMO_RECORDS)], DEMO_TIMEOUT_S, tmp_path)
    assert "worker-0 killed with a prepared, undecided part" in out, out
    rows = _table(out, "sink ")
    assert set(rows) == {"pg", "mongo", "files"}, out
    for sink, (records, distinct, dupes, missing, prepared, staged) in rows.items():
        assert (records, distinct, dupes, missing, prepared, staged) == (
            DEMO_RECORDS,
            DEMO_RECORDS,
            0,
            0,
            0,
            0,
        ), f"{sink}: {out}"
    assert "VERIFIED: every record exactly once in every sink" in out, out
    print(f"harness.demo --records {DEMO_RECORDS}: {elapsed:.0f}s")


@pytest.mark.spark
@pytest.mark.timeout(SPARK_TIMEOUT_S + 60)
def test_spark_demo_with_its_driver_kill(tmp_path: Path) -> None:
    out, elapsed = _run(
        ["harness.spark_demo", "--events", str(SPARK_EVENTS)], SPARK_TIMEOUT_S, tmp_path
    )
    assert "driver SIGKILLed" in out, out
    rows = _table(out, "   sink ")
    assert set(rows) == {"pg", "mongo", "files"}, out
    for sink, (records, distinct, dupes, missing, prepared, staged) in rows.items():
        assert (records, distinct, dupes, missing, prepared, staged) == (
            SPARK_EVENTS,
            SPARK_EVENTS,
            0,
            0,
            0,
            0,
        ), f"{sink}: {out}"
    assert "every order exactly once in every sink" in out, out
    assert "SPARK DEMO VERIFIED" in out, out
    print(f"harness.spark_demo --events {SPARK_EVENTS}: {elapsed:.0f}s")


CDC_CHANGES = 800
CDC_TIMEOUT_S = 360


@pytest.mark.connect
@pytest.mark.timeout(CDC_TIMEOUT_S + 60)
def test_cdc_demo_replicates_every_table_through_its_kill(tmp_path: Path) -> None:
    """`make demo-cdc` at a smaller size: Debezium, four tables (one created while running, one
    keyed on two columns), a participant killed after its prepare, every table compared."""
    out, elapsed = _run(
        ["harness.cdc_demo", "--changes", str(CDC_CHANGES)], CDC_TIMEOUT_S, tmp_path
    )
    assert "worker-0 killed with a prepared, undecided part" in out, out
    assert "created table refunds on the source while the pipeline runs" in out, out
    equal = re.findall(r"^(\w+)\s+(\d+)\s+(\d+)\s+(yes|NO)$", out, re.MULTILINE)
    assert {t for t, *_ in equal} == {"customers", "orders", "order_lines", "refunds"}, out
    assert all(same == "yes" and src == got for _t, src, got, same in equal), out
    assert "prepared transactions left: 0; dead letters: 0" in out, out
    assert "VERIFIED: every replica table equals its source table" in out, out
    print(f"harness.cdc_demo --changes {CDC_CHANGES}: {elapsed:.0f}s")
