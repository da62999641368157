"""`twophase init`: a newcomer's first pipeline on the local stack, the way README.md tells it.

init -> validate -> topics create -> coordinator + participant (real processes) -> a producer of
one's own -> the records are in PostgreSQL, MongoDB and the Parquet files; `twophase status` is
healthy. Plus the refusals: an existing file is kept unless --force; no stack, a clear error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pyarrow.dataset as ds
import pytest
from confluent_kafka import Producer
from pymongo import MongoClient

from harness import wait_until
from tests.cli.conftest import run_cli
from twophase.config import load_config

pytestmark = pytest.mark.stack

RECORDS = 12
#: Processes start, join the group, and the first cycles commit within seconds; slack for a
#: shared 2-core machine.
LAND_TIMEOUT_S = 120


def test_init_writes_a_starter_and_keeps_an_existing_file(
    tmp_path: Path, stack_env: dict[str, str]
) -> None:
    target = tmp_path / "pipeline.yaml"
    result = run_cli("init", str(target), "--name", "starter")
    assert result.exit_code == 0, result.output
    text = target.read_text()
    cfg = load_config(target)
    assert cfg.pipeline == "starter" and cfg.source_topics == ["starter"]
    assert cfg.kafka.bootstrap_servers == stack_env["TWOPHASE_KAFKA_BOOTSTRAP"]
    assert {s["type"] for s in cfg.sinks} == {"postgres", "mongodb", "files"}
    assert run_cli("validate", str(target)).exit_code == 0

    target.write_text("# mine\n")
    refused = run_cli("init", str(target), "--name", "starter")
    assert refused.exit_code == 1
    assert "exists" in refused.output and "--force" in refused.output
    assert target.read_text() == "# mine\n"

    forced = run_cli("init", str(target), "--name", "starter", "--force")
    assert forced.exit_code == 0, forced.output
    assert target.read_text() == text


def test_init_without_a_stack_says_how_to_start_it(tmp_path: Path) -> None:
    result = run_cli("init", str(tmp_path / "p.yaml"), "--stack-env", str(tmp_path / "none.env"))
    assert result.exit_code == 1
    assert "make stack-up" in result.output
    assert not (tmp_path / "p.yaml").exists()


def test_init_refuses_a_bad_name(tmp_path: Path) -> None:
    result = run_cli("init", str(tmp_path / "p.yaml"), "--name", "no spaces")
    assert result.exit_code == 2 and "--name" in result.output
    assert not (tmp_path / "p.yaml").exists()


def _twophase(*args: str, cwd: Path, stack_dir: str) -> subprocess.CompletedProcess[str]:
    # The stack the other tests use, however pytest was started (make exports
    # TWOPHASE_STACK_DIR; a bare pytest run finds <repo>/.stack, which is not the cwd here).
    return subprocess.run(
        [sys.executable, "-m", "twophase.cli.main", *args],
        cwd=cwd,
        env={**os.environ, "TWOPHASE_STACK_DIR": stack_dir},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_first_pipeline_from_init_to_records_in_every_sink(
    tmp_path: Path, unique_name: str, stack_env: dict[str, str]
) -> None:
    name = f"first-{unique_name}".replace("_", "-")
    table = name.replace("-", "_")
    for step in (
        ("init", "--name", name),
        ("validate", "pipeline.yaml"),
        ("topics", "create", "pipeline.yaml"),
    ):
        done = _twophase(*step, cwd=tmp_path, stack_dir=stack_env["TWOPHASE_STACK_DIR"])
        assert done.returncode == 0, (step, done.stdout, done.stderr)

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "twophase.cli.main", role, "run", "pipeline.yaml"],
            cwd=tmp_path,
            env={**env, "TWOPHASE_PARTICIPANT_ID": f"{role}-1"},
            stdout=(tmp_path / f"{role}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        for role in ("coordinator", "participant")
    ]
    mongo: MongoClient[dict[str, object]] = MongoClient(stack_env["TWOPHASE_MONGO_URI"])
    try:
        # A producer of the user's own: plain JSON objects with an id.
        producer = Producer({"bootstrap.servers": stack_env["TWOPHASE_KAFKA_BOOTSTRAP"]})
        for i in range(1, RECORDS + 1):
            order = {"id": i, "customer": f"c-{i}", "amount": round(9.5 * i, 2)}
            producer.produce(name, key=str(i), value=json.dumps(order))
        assert producer.flush(30) == 0

        def pg_rows() -> int:
            with psycopg.connect(stack_env["TWOPHASE_PG_DSN"]) as conn:
                exists = conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()
                if not exists or exists[0] is None:
                    return 0
                row = conn.execute(f"SELECT count(DISTINCT id) FROM {table}").fetchone()
                return int(row[0]) if row else 0

        def file_rows() -> int:
            root = tmp_path / f"{name}-files" / name
            if not root.exists():
                return 0
            return int(ds.dataset(root, format="parquet", partitioning="hive").count_rows())

        def landed() -> bool:
            return (
                pg_rows() == RECORDS
                and mongo["twophase"][table].count_documents({}) == RECORDS
                and file_rows() == RECORDS
            )

        try:
            wait_until(landed, LAND_TIMEOUT_S, "the records to land in every sink", every_s=1.0)
        except TimeoutError:
            for role in ("coordinator", "participant"):
                print(f"--- {role}\n{(tmp_path / f'{role}.log').read_text()[-3000:]}")
            raise
        status = _twophase(
            "status",
            "pipeline.yaml",
            "--json",
            cwd=tmp_path,
            stack_dir=stack_env["TWOPHASE_STACK_DIR"],
        )
        assert status.returncode == 0, status.stdout + status.stderr
        report = json.loads(status.stdout)
        assert report["healthy"] and report["total_lag"] == 0, report
        assert all(p.poll() is None for p in procs), "a process died"
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        mongo["twophase"].drop_collection(table)
        mongo.close()
        with psycopg.connect(stack_env["TWOPHASE_PG_DSN"], autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")
