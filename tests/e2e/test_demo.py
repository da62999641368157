"""`make demo` end to end, through the same code, at a smaller size: the front door must not break
without this test failing.

Both halves run as `make demo` runs them (`python -m harness.demo`, `python -m harness.spark_demo`) on
the local stack, with their crashes: a participant killed right after its 3rd vote, and the Spark
writer's driver killed with every part of a batch prepared. Only the record counts are smaller.
"""

from __future__ import annotations

import os
import re
import signal
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
    # In a session of its own: on a timeout the demo and every process it started go (the
    # demo's pipeline processes outlived a killed demo once, committing empty parts for good).
    proc = subprocess.Popen(
        [sys.executable, "-m", *args, "--workdir", str(workdir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"{' '.join(args)} did not end within {timeout_s:.0f}s\n"
            f"--- stdout\n{stdout[-6000:]}\n--- stderr\n{stderr[-4000:]}"
        ) from None
    run = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
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
    assert set(rows) == {"pg", "mongo", "files", "iceberg"}, out
    for sink, (records, distinct, dupes, missing, prepared, staged) in rows.items():
        assert (records, distinct, dupes, missing, prepared, staged) == (
            DEMO_RECORDS,
            DEMO_RECORDS,
            0,
            0,
            0,
            0,
        ), f"{sink}: {out}"
    assert f"Iceberg through Spark SQL {DEMO_RECORDS:,}" in out, out
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


# make demo-cdc runs 3,000 changes at 20/s; 800 at 60/s still span the new table and the kill.
CDC_CHANGES = 800
CDC_RATE = 60
CDC_TIMEOUT_S = 360
#: A row of the demo's comparison: table, source rows, then each sink's rows, then equal.
CDC_ROW = re.compile(r"^(\w+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(yes|NO.*)$", re.MULTILINE)


@pytest.mark.connect
@pytest.mark.timeout(CDC_TIMEOUT_S + 60)
def test_cdc_demo_replicates_every_table_through_its_kill(tmp_path: Path) -> None:
    """`make demo-cdc` at a smaller size: Debezium, four tables (one created while running, one
    keyed on two columns), a participant killed after its prepare halfway through, every table
    compared in each sink -- PostgreSQL, MongoDB, the replayed change files."""
    out, elapsed = _run(
        ["harness.cdc_demo", "--changes", str(CDC_CHANGES), "--rate", str(CDC_RATE)],
        CDC_TIMEOUT_S,
        tmp_path,
    )
    assert "worker-0 killed with a prepared, undecided part; restarting it" in out, out
    assert "created table refunds on the source while the pipeline runs" in out, out
    rows = {t: rest for t, *rest in CDC_ROW.findall(out)}
    assert set(rows) == {"customers", "orders", "order_lines", "refunds"}, out
    for table, (src, pg, mongo, files, equal) in rows.items():
        assert equal == "yes" and src == pg == mongo == files and int(src) > 0, f"{table}: {out}"
    for kind in ("insert", "update", "delete", "key change", "delete+reinsert"):
        assert f"'{kind}': " in out, out
    assert (
        "left behind: prepared in PostgreSQL 0, staged in MongoDB 0, staged files 0; "
        "dead letters: 0" in out
    ), out
    assert "VERIFIED: every sink of every table equals its source table" in out, out
    print(f"harness.cdc_demo --changes {CDC_CHANGES} --rate {CDC_RATE}: {elapsed:.0f}s")
