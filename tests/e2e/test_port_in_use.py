"""A metrics port already in use ends every process that opens it, in one line naming the port
and the setting, with status 2 -- never a traceback, never a process that stays up unready."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from harness import Cluster
from tests.e2e.e2e_support import ends_in_one_line, scenario


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
        env = {"TWOPHASE__METRICS__PORT": str(port)}
        line = ends_in_one_line(c, role, env, "metrics.port")
        assert f"127.0.0.1:{port}" in line, line
    finally:
        c.stop_all()
        holder.close()
