"""The example third-party sink, installed the way a user would: pip, entry points, the CLI.

pip installs ``examples/twophase-sqlite-sink`` into a temporary target directory (never into the
shared venv, so no other test ever sees a fourth sink), and the checks run in a subprocess that
has that directory on its path: what ``twophase sinks list`` and the registry find there comes
from the package's installed entry-point metadata and nothing else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "twophase-sqlite-sink"
#: pip builds the wheel with hatchling in an isolated environment: a download the first time,
#: seconds from pip's cache afterwards.
PIP_TIMEOUT_S = 300
CLI_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
         str(EXAMPLE)],
        check=True,
        timeout=PIP_TIMEOUT_S,
    )  # fmt: skip
    return target


def _run(site: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, *args],
        env=env,
        cwd=site,  # not the repository: nothing importable by accident
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_installed_sink_is_listed_by_the_cli(site: Path) -> None:
    listed = json.loads(_run(site, "-m", "twophase.cli.main", "sinks", "list", "--json"))
    assert listed["sqlite"] == "twophase_sqlite:SqliteSink"
    assert {"postgres", "mongodb", "files"} <= set(listed)


def test_installed_sink_works_through_the_registry(site: Path, tmp_path: Path) -> None:
    """A pipeline's sinks[] entry with ``type: sqlite`` builds and runs a part end to end."""
    script = textwrap.dedent(
        f"""
        import sqlite3
        from twophase.participants.registry import build_sinks
        from twophase.participants.sdk import PartId, Record

        db = {str(tmp_path / "orders.db")!r}
        raw = {{"name": "orders-db", "type": "sqlite", "path": db, "table": "orders",
                "columns": {{"id": "TEXT", "n": "INTEGER CHECK (n >= 0)"}}}}
        (sink,) = build_sinks([raw], pipeline="p", participant="w1")
        sink.setup()
        part = PartId("p", 1, "w1")
        sink.begin(part)
        rejected = sink.write(part, [Record("t", 0, o, 0, None, {{"id": f"r{{o}}", "n": o - 1}})
                                     for o in range(3)])
        sink.prepare(part, {{("t", 0): 3}})
        sink.commit(part)
        rows = sqlite3.connect(db).execute("SELECT id FROM orders ORDER BY id").fetchall()
        print(type(sink).__module__, [r.record.offset for r in rejected], rows,
              sink.committed_positions())
        """
    )
    out = _run(site, "-c", script).split(maxsplit=1)
    assert out[0] == "twophase_sqlite"
    assert out[1].strip() == "[0] [('r1',), ('r2',)] {('t', 0): 3}"
