"""stack/stack.sh itself: a second `up` finds everything running and changes nothing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.stack

STACK_SH = Path(__file__).resolve().parents[2] / "stack" / "stack.sh"


def _run(stack_env: dict[str, str], command: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "TWOPHASE_STACK_DIR": stack_env["TWOPHASE_STACK_DIR"],
        "TWOPHASE_CACHE_DIR": stack_env["TWOPHASE_CACHE_DIR"],
    }
    return subprocess.run(
        ["bash", str(STACK_SH), command], env=env, capture_output=True, text=True, timeout=120
    )


def test_second_up_is_a_no_op(stack_env: dict[str, str]) -> None:
    before = Path(stack_env["TWOPHASE_STACK_DIR"], "stack.env").read_text()
    result = _run(stack_env, "up")
    assert result.returncode == 0, result.stderr
    for service in ("kafka", "postgres", "mongo", "registry"):
        assert f"{service}: already running" in result.stderr
    for work in ("fetching", "installing", "building"):
        assert work not in result.stderr
    assert Path(stack_env["TWOPHASE_STACK_DIR"], "stack.env").read_text() == before


def test_status_reports_every_service_up(stack_env: dict[str, str]) -> None:
    result = _run(stack_env, "status")
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line.split()[1] for line in result.stdout.splitlines()[:4]}
    assert lines == {"kafka": "up", "postgres": "up", "mongo": "up", "registry": "up"}
    assert stack_env["TWOPHASE_KAFKA_BOOTSTRAP"] in result.stdout
