"""``twophase status`` against a live pipeline: it sees what the coordinator sees, whatever the
latest checkpoint hides, and it answers in bounded time whatever a store does.

* A stalled partition (records waiting, no commit moving its position for
  ``commit.stall_alarm_s``) is unhealthy, with checkpoints written after every cycle -- the old
  status only looked back to the latest checkpoint and said healthy.
* With no commit decision since the latest checkpoint the last commit is still found (the old
  status said "the last commit is Nones old").
* A commit decided and not applied (its participant died before committing) is unhealthy.
* A MongoDB server that accepts connections and answers nothing (SIGSTOP) costs status a
  bounded wait, reported as the sink's error.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import yaml

from harness import Cluster, load_stack_env, produce, wait_until
from tests.e2e.e2e_support import http_get, metric, scenario, scrape, start

STALL_S = 3


def _status(config: Path, *extra: str, timeout_s: float = 120) -> tuple[int, dict[str, Any], float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "twophase.cli.main", "status", str(config), "--json", *extra],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    elapsed = time.monotonic() - started
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, json.loads(done.stdout), elapsed


def test_status_sees_a_stall_older_than_the_latest_checkpoint(tmp_path: Path) -> None:
    s = scenario(
        tmp_path,
        "stsee",
        partitions=2,
        mongo=False,
        files=False,
        extra={
            # A checkpoint after every cycle: the tail after it almost never holds a decision.
            "commit": {
                "interval_ms": 500,
                "vote_timeout_ms": 10_000,
                "stall_alarm_s": STALL_S,
                "checkpoint_every": 1,
            }
        },
    )
    c = Cluster(s)
    try:
        cport = start(c, "coordinator", "coord-0")
        pport = start(c, "participant", "p-stuck", env={"TWOPHASE_STALL": "reads"})
        wait_until(lambda: http_get(pport, "/readyz")[0] == 200, 60, "the participant's readiness")
        produce(s.bootstrap, s.topic, 0, 300)
        try:
            wait_until(
                lambda: metric(scrape(cport), "twophase_stalled_partitions") == 2,
                60,
                "the coordinator's stall alarm on both partitions",
            )
        except TimeoutError:
            print(scrape(cport))
            raise
        for _ in range(3):  # whichever message the tail ends with
            code, st, _ = _status(s.config_path, "--no-sinks")
            assert code == 1 and not st["healthy"], st
            stalled = [p for p in st["problems"] if "no commit has moved its position" in p]
            assert len(stalled) == 2, st["problems"]
            for p in st["partitions"]:
                assert p["unmoved_s"] is not None and p["unmoved_s"] >= STALL_S, p
            # Cycles commit all along (empty parts): the last commit is recent and known.
            assert st["last_commit_txn"] is not None, st
            assert st["last_commit_age_s"] is not None and st["last_commit_age_s"] < 10, st
            assert not any("None" in p for p in st["problems"]), st["problems"]
            time.sleep(0.3)
    finally:
        c.stop_all()


def test_status_says_unhealthy_when_a_commit_stays_unapplied(tmp_path: Path) -> None:
    s = scenario(tmp_path, "stunap", partitions=1, mongo=False, files=False)
    c = Cluster(s)
    try:
        start(c, "coordinator", "coord-0")
        # Dies (SIGKILL) before committing its first decided part: the commit stays pending.
        start(c, "participant", "p-0", env={"TWOPHASE_CRASH_AT": "before_commit:1"})
        produce(s.bootstrap, s.topic, 0, 50)
        wait_until(lambda: not c.alive("p-0"), 90, "the participant to die before committing")
        time.sleep(3)
        code, st, _ = _status(s.config_path, "--no-sinks", "--max-commit-age", "2")
        assert code == 1, st
        assert st["pending_commits"], st
        late = [p for p in st["problems"] if "not applied by every participant" in p]
        assert len(late) == 1, st["problems"]
        # A participant starting again applies the decided part (in-doubt resolution): nothing
        # stays prepared -- a leftover would also hold up every later logical replication slot
        # on this server (Debezium's CREATE_REPLICATION_SLOT waits for it).
        start(c, "participant", "p-1")
        wait_until(lambda: _prepared(s.pg_dsn, s.name) == 0, 120, "the pending commit applied")
    finally:
        c.stop_all()


def _prepared(dsn: str, pipeline: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE %s", (f"%{pipeline}~%",)
        ).fetchone()
    return int(row[0]) if row else 0


class _StallingProxy:
    """A TCP proxy in front of the stack's MongoDB that forwards until a client sends
    ``trigger`` (a command name), then forwards nothing more, keeping every connection open: a
    server that was found and then stopped answering -- operations wait on the socket (the
    driver's socket time-out, 120 s by default), not on server selection. SIGSTOP on the
    server can't be timed to land after the client has found it."""

    def __init__(self, target: tuple[str, int], trigger: bytes) -> None:
        self.target = target
        self.trigger = trigger
        self.stalled = threading.Event()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = int(self.listener.getsockname()[1])
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            if self.trigger in data:
                self.stalled.set()
            while self.stalled.is_set():  # hold it: the peer waits for an answer forever
                time.sleep(0.5)
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def test_status_is_bounded_while_mongodb_answers_nothing(tmp_path: Path) -> None:
    s = scenario(tmp_path, "stmstop", partitions=1, files=False)
    env = load_stack_env()
    host_port = env["TWOPHASE_MONGO_URI"].split("//", 1)[1].split("/")[0]
    proxy = _StallingProxy(("127.0.0.1", int(host_port.split(":")[1])), trigger=b"listCollections")
    raw = s.config()
    for sink in raw["sinks"]:
        if sink["type"] == "mongodb":
            # Only through the proxy: the replica set's own member address would bypass it.
            sink["uri"] = f"mongodb://127.0.0.1:{proxy.port}/?directConnection=true"
            # A patient client (a slow network): the driver's own time-outs alone would keep
            # status waiting for minutes.
            sink["connect_timeout_s"] = 60
    s.config_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    try:
        code, st, elapsed = _status(s.config_path, timeout_s=100)
    finally:
        proxy.close()
    assert proxy.stalled.is_set()
    # Kafka answers; the silent store is reported as the sink's error, within the probe's limit.
    assert elapsed < 30, elapsed  # the probe limit (10 s) and the Kafka reads
    mongo = next(e for e in st["sinks"] if e["name"] == "mongo")
    assert "error" in mongo, mongo
    pg = next(e for e in st["sinks"] if e["name"] == "pg")
    assert "error" not in pg, pg
    del code  # health is the log's and Kafka's: not what this test is about
