"""``twophase validate --live`` runs the processes' start-up checks against the real stack, and
every entry point validates a config the same way.

* A target table that does not exist, and a PostgreSQL server with
  ``max_prepared_transactions = 0`` (a second server started here from the stack's binaries),
  pass plain ``validate`` and stop a participant at start-up: ``--live`` reports both.
* A sink type ``validate`` rejects is rejected by ``coordinator run``, ``participant run``,
  ``status`` and ``topics describe`` too -- one line, the field named.
* A coordinator started without ``control.hmac_key`` says so.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

from harness import Cluster, Scenario, load_stack_env, wait_until
from tests.cli.conftest import run_cli
from tests.e2e.e2e_support import scenario
from tests.e2e.secure_broker import free_port


def _write(s: Scenario, raw: dict[str, Any]) -> Path:
    s.config_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return s.config_path


def test_live_validate_passes_a_sound_config(tmp_path: Path) -> None:
    s = scenario(tmp_path, "vlok", partitions=1, files=False)
    result = run_cli("validate", str(s.config_path), "--live", "--timeout", "20")
    assert result.exit_code == 0, result.output
    assert "ok against the live stack" in result.output, result.output


def test_live_validate_reports_a_missing_target_table(tmp_path: Path) -> None:
    s = scenario(tmp_path, "vltab", partitions=1, mongo=False, files=False)
    with psycopg.connect(s.pg_dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE {s.table}")
    assert run_cli("validate", str(s.config_path)).exit_code == 0  # offline: nothing to see
    result = run_cli("validate", str(s.config_path), "--live", "--timeout", "20")
    assert result.exit_code == 1, result.output
    assert f"target table {s.table} does not exist" in result.output, result.output
    assert "problem sink pg:" in result.output, result.output


@pytest.fixture
def pg_without_2pc() -> Iterator[str]:
    """A second PostgreSQL server, from the stack's binaries, with max_prepared_transactions=0:
    its DSN."""
    pg_bin = Path(load_stack_env()["TWOPHASE_PG_BIN"])
    root = Path(tempfile.mkdtemp(prefix="twophase-pg0-"))
    root.chmod(0o755)
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    port = free_port()
    as_pg: list[str] = []
    if os.geteuid() == 0:  # initdb and postgres refuse to run as root (as stack.sh does)
        pg = pwd.getpwnam("postgres")
        os.chown(root, pg.pw_uid, pg.pw_gid)
        os.chown(sock, pg.pw_uid, pg.pw_gid)
        as_pg = [shutil.which("runuser") or "/usr/sbin/runuser", "-u", "postgres", "--"]
    subprocess.run(
        [*as_pg, str(pg_bin / "initdb"), "-D", str(data), "-U", "twophase", "--auth=trust"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    opts = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c max_prepared_transactions=0"
    subprocess.run(
        [
            *as_pg,
            str(pg_bin / "pg_ctl"),
            "-D",
            str(data),
            "-w",
            "-o",
            opts,
            "-l",
            str(root / "log"),
            "start",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    try:
        yield f"postgresql://twophase@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*as_pg, str(pg_bin / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(root, ignore_errors=True)


def test_live_validate_reports_a_server_without_prepared_transactions(
    tmp_path: Path, pg_without_2pc: str
) -> None:
    s = scenario(tmp_path, "vl2pc", partitions=1, mongo=False, files=False)
    raw = s.config()
    raw["sinks"][0]["dsn"] = pg_without_2pc
    raw["sinks"][0]["create_table"] = {"id": "bigint"}
    path = _write(s, raw)
    assert run_cli("validate", str(path)).exit_code == 0  # offline: nothing to see
    result = run_cli("validate", str(path), "--live", "--timeout", "20")
    assert result.exit_code == 1, result.output
    assert "max_prepared_transactions is 0" in result.output, result.output


def _one_line_refusal(out: str, code: int) -> None:
    assert code != 0, out
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if "sinks[0].type" in line]
    assert len(lines) == 1, out
    assert "unknown sink type 'postgress'" in lines[0], out


def test_every_entry_point_rejects_what_validate_rejects(tmp_path: Path) -> None:
    s = scenario(tmp_path, "vlone", partitions=1, mongo=False, files=False)
    raw = s.config()
    raw["sinks"][0]["type"] = "postgress"
    path = _write(s, raw)
    for command, options in (
        (["validate"], []),
        (["status"], ["--no-sinks"]),
        (["topics", "describe"], []),
        (["txn", "list"], []),
    ):
        result = run_cli(*command, str(path), *options)
        _one_line_refusal(result.output, result.exit_code)
    for role in ("coordinator", "participant"):
        try:
            done = subprocess.run(
                [sys.executable, "-m", "twophase.cli.main", role, "run", str(path)],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"`{role} run` accepted a sink type `validate` rejects")
        assert done.returncode == 2, (role, done.returncode, done.stderr)
        _one_line_refusal(done.stdout + done.stderr, done.returncode)


def test_a_bad_librdkafka_setting_is_refused_by_every_entry_point(tmp_path: Path) -> None:
    """librdkafka checks its settings only when a client is made: `validate` passed them and
    `coordinator run` died on a KafkaException traceback."""
    s = scenario(tmp_path, "vlkafka", partitions=1, mongo=False, files=False)
    raw = s.config()
    raw["kafka"]["config"] = {"no.such.setting": "x"}
    path = _write(s, raw)
    field = "kafka.config.no.such.setting"
    result = run_cli("validate", str(path))
    assert result.exit_code != 0 and field in result.output, result.output
    for role in ("coordinator", "participant"):
        done = subprocess.run(
            [sys.executable, "-m", "twophase.cli.main", role, "run", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        out = done.stdout + done.stderr
        assert done.returncode == 2, (role, out)
        assert "Traceback" not in out, out
        assert len([line for line in out.splitlines() if field in line]) == 1, out


def test_coordinator_warns_when_control_messages_are_not_authenticated(tmp_path: Path) -> None:
    s = scenario(tmp_path, "vlhmac", partitions=1, mongo=False, files=False)
    raw = s.config()
    del raw["control"]["hmac_key"]
    _write(s, raw)
    c = Cluster(s)
    try:
        c.start("coordinator", "coord-0")
        wait_until(
            lambda: "coordinator coord-0 for pipeline" in c.log_tail("coord-0", 100), 60, "start"
        )
        warned = [
            line for line in c.log_tail("coord-0", 100).splitlines() if "control.hmac_key" in line
        ]
        assert len(warned) == 1 and "WARNING" in warned[0], c.log_tail("coord-0", 100)
    finally:
        c.stop_all()
