"""A full disk under the files sink (issue #21, item 3), on the real stack.

The files sink's ``path`` is a small tmpfs of its own. A first batch goes through; then the
test shrinks the tmpfs to what it holds plus a small remainder (``mount -o remount,size=``),
and the pipeline's records fill the rest while more keep arriving. What must hold while the disk is full:

* no process exits; the files sink says ``No space left on device`` and the parts it cannot
  write or prepare are aborted (abort decisions), the rest of the pipeline retries;
* nothing half-written is visible: every file in the dataset's published area is a complete
  Parquet file (its footer reads) and no temporary name appears there;
* PostgreSQL never commits a part the files sink could not take: every id committed in
  PostgreSQL is, at every sample, in a visible or a staged (prepared) files part.

Then the tmpfs is remounted bigger; writing resumes and every record ends up exactly once in
both sinks, nothing prepared or staged left (``harness.verify``).

The test needs root and ``mount -t tmpfs``. Where that is refused the test FAILS and says so:
a skipped integration test is a test that cannot fail.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import psycopg
import pyarrow.parquet as pq
import pytest
import yaml

from harness import Cluster, Scenario, control_decisions, produce, summary_json
from harness.store_faults import Tmpfs, TmpfsRefused
from tests.e2e.e2e_support import scenario, settle

pytestmark = pytest.mark.stack

#: The tmpfs: big enough for the first batch.
TMPFS_SIZE = 8 << 20
#: What the filled disk leaves free: a handful of the pipeline's parts, so its own records fill it.
LEFT_FREE = 160 * 1024
#: After the first ENOSPC, how long the disk stays full while records keep arriving.
FULL_FOR_S = 25.0
#: Records per produced batch during the full phase, and the pause between batches.
BATCH, EVERY_S = 500, 0.5
#: The participant's give-up budget for retriable sink calls: short, so a part the files sink
#: cannot begin is given up (and re-read) within the test's window.
SINK_RETRY_S = 10.0


def _mount_tmpfs(path: Path, size: int) -> Tmpfs:
    try:
        return Tmpfs(path, size)
    except TmpfsRefused as exc:
        pytest.fail(
            f"{exc} (run this test as root, or in a user and mount namespace: `unshare -rm`)",
            pytrace=False,
        )


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _visible_ids(s: Scenario) -> list[int]:
    """Ids in the published area; fails on a file that is not a complete Parquet file."""
    data = s.files_path / s.topic
    ids: list[int] = []
    if not data.exists():
        return ids
    for f in data.rglob("*"):
        if f.is_dir():
            continue
        name = f.name
        assert not name.startswith(".") and name.endswith(".parquet"), f"stray file {f}"
        try:
            ids.extend(pq.read_table(f, columns=["id"]).column("id").to_pylist())
        except FileNotFoundError:
            continue
        except Exception as exc:  # a truncated file: its footer does not read
            raise AssertionError(f"half-written file visible: {f}: {exc}") from exc
    return ids


def _staged_ids(s: Scenario) -> set[int]:
    """Ids in prepared (staged, fsynced) parts of the files sink."""
    out: set[int] = set()
    prepared = s.files_path / "_twophase" / s.name / "prepared"
    if not prepared.exists():
        return out
    for f in prepared.glob("*/*.parquet"):
        with contextlib.suppress(FileNotFoundError, OSError):
            out.update(pq.read_table(f, columns=["id"]).column("id").to_pylist())
    return out


def _pg_ids(s: Scenario) -> set[int]:
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        return {r[0] for r in conn.execute(f"SELECT id FROM {s.table}")}


def _check_atomic(s: Scenario) -> None:
    """Every id PostgreSQL committed is in a files part that is prepared or published (read
    in this order: a part only moves from staged to published, and stays published)."""
    in_pg = _pg_ids(s)
    staged = _staged_ids(s)
    visible = set(_visible_ids(s))
    missing = in_pg - staged - visible
    assert not missing, (
        f"PostgreSQL committed {len(missing)} ids the files sink never prepared: "
        f"{sorted(missing)[:10]}"
    )


def test_full_disk_under_the_files_sink_aborts_parts_and_resumes(
    tmp_path: Path, pg_dsn: str, kafka_bootstrap: str
) -> None:
    s = scenario(tmp_path, "fulldisk", partitions=2, mongo=False)
    raw = s.config()
    raw["participant"] = {"sweep_interval_ms": 5_000, "sink_retry_s": SINK_RETRY_S}
    s.config_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    c = Cluster(s)
    produced = 0
    disk = _mount_tmpfs(
        s.files_path, TMPFS_SIZE
    )  # unmounted by the finally below, whatever happens
    try:
        c.start("coordinator", "coord-0")
        c.start("participant", "p-0")
        first = 2_000
        produce(s.bootstrap, s.topic, 0, first)
        produced = first
        report = settle(s, c, set(range(first)), 120)
        assert all(r.ok for r in report.values()), summary_json(report)

        # The disk fills: shrunk to what it holds and a little more, which the pipeline's own
        # records then fill.
        disk.fill(LEFT_FREE)
        log = c.logs / "p-0.log"
        enospc = "No space left on device"
        t0 = time.monotonic()
        while enospc not in log.read_text(errors="replace"):
            assert time.monotonic() - t0 < 90, "the files sink never met the full disk"
            produce(s.bootstrap, s.topic, produced, BATCH)
            produced += BATCH
            assert c.alive("p-0") and c.alive("coord-0"), c.log_tail("p-0", 60)
            time.sleep(EVERY_S)
        full_at = time.monotonic()
        print(f"files sink met ENOSPC after {full_at - t0:.1f}s, {produced} records produced")
        next_check = 0.0
        while time.monotonic() - full_at < FULL_FOR_S:
            produce(s.bootstrap, s.topic, produced, BATCH)
            produced += BATCH
            assert c.alive("p-0"), c.log_tail("p-0", 80)
            assert c.alive("coord-0"), c.log_tail("coord-0", 80)
            if time.monotonic() >= next_check:
                _check_atomic(s)
                next_check = time.monotonic() + 3
            time.sleep(EVERY_S)
        _check_atomic(s)
        assert _free_bytes(s.files_path) < LEFT_FREE, "the disk was not full"

        # Space returns.
        disk.resize(64 << 20)
        assert _free_bytes(s.files_path) > 32 * 1024 * 1024
        expected = set(range(produced))
        report = settle(s, c, expected, 240, apply_timeout_s=90)
        print(summary_json(report))
        for sink, r in report.items():
            assert r.ok and r.distinct == produced, f"{sink}: {r}"
        assert c.alive("p-0") and c.alive("coord-0")
        _check_atomic(s)
    finally:
        c.stop_all()
        disk.unmount()
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-4000:]
    decisions = control_decisions(s)
    aborted = [d for d in decisions if d[2] == "abort"]
    print(f"{len(decisions)} decisions, {len(aborted)} aborts: {[d[3] for d in aborted][:5]}")
    # The parts the full disk refused were aborted, not committed half-way.
    assert aborted, "no part was aborted while the disk was full"
