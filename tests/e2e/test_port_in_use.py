"""A metrics port already in use ends every process that opens it, in one line naming the port
and the setting, with status 2 -- never a traceback, never a process that stays up unready."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from harness import Cluster
from tests.e2e.e2e_support import scenario


@pytest.mark.parametrize(
    ("role", "mode"),
    [
        ("coordinator", "exactly_once"),
        ("participant", "exactly_once"),
        ("participant", "at_least_once"),
    ],
)
def test_a_taken_metrics_port_is_one_line_and_status_2(
    tmp_path: Path, role: str, mode: str
) -> None:
    s = scenario(
        tmp_path,
        f"port-{role[:5]}",
        partitions=1,
        mongo=False,
        files=False,
        extra={"participant": {"mode": mode}},
    )
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    c = Cluster(s)
    try:
        proc = c.start(
            role,
            f"{role}-0",
            {"TWOPHASE__METRICS__PORT": str(port), "TWOPHASE__METRICS__HOST": "127.0.0.1"},
        )
        try:
            code = proc.wait(90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{role} still running with its port taken:\n{c.log_tail(f'{role}-0')}")
        log = c.log_tail(f"{role}-0", 200)
        assert code == 2, (code, log)
        assert "Traceback" not in log, log
        lines = [line for line in log.splitlines() if "metrics.port" in line]
        assert len(lines) == 1, log
        assert f"127.0.0.1:{port}" in lines[0], lines[0]
    finally:
        c.stop_all()
        holder.close()
