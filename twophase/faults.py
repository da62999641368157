"""Fault injection for the chaos run and the end-to-end tests (no effect unless armed).

``TWOPHASE_CRASH_AT=<name>:<n>`` kills the process (SIGKILL, no clean-up) the n-th time it passes
``crash_point(name)``. ``TWOPHASE_CRASH_FILE=<path>`` arms a *running* process: whenever the file
holds ``<name>:<n>[:<tag>]``, the n-th pass of ``name`` after that content first appeared kills
it (the chaos run writes a fresh tag per arming, so the same point can be armed twice).

Participant points: before_vote, after_vote, after_prepare, before_commit, mid_commit (after
each sink of a commit). Coordinator points: after_prepare_sent, mid_decision (DECISION produced,
its Kafka transaction not yet committed), after_decision (committed). Spark driver points:
spark_after_prepare (every task prepared, no decision), spark_after_decision, spark_mid_apply
(the first sink applied the decision, the others not yet).

``TWOPHASE_DELAY_AT=<name>:<n>:<seconds>`` sleeps once, the n-th time ``delay_point(name)`` is
passed: the tests hold a participant still there while the group rebalances around it
(participant delay points: before_recovery, on_prepare, after_consume -- the data thread with a
batch fetched and not yet written -- before_vote) or the broker goes away.

``TWOPHASE_STALL=reads`` makes a participant stop reading its partitions while it goes on
voting (empty parts): the stall the coordinator's stall alarm is there to see.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

__all__ = ["crash_point", "delay_point", "stalled"]

_lock = threading.Lock()
_armed: dict[str, int] = {}  # file content -> passes seen since it appeared


def crash_point(name: str) -> None:
    """Fault injection for the chaos and end-to-end tests: ``TWOPHASE_CRASH_AT=name:n`` kills the
    process (SIGKILL, no clean-up) the n-th time it passes ``name``."""
    spec = os.environ.get("TWOPHASE_CRASH_AT", "")
    if spec.startswith(name + ":"):
        count = int(os.environ.get("_TWOPHASE_CRASH_COUNT", "0")) + 1
        os.environ["_TWOPHASE_CRASH_COUNT"] = str(count)
        if count >= int(spec.split(":")[1]):
            _die(name)
    path = os.environ.get("TWOPHASE_CRASH_FILE")
    if path:
        _file_point(name, path)


def _file_point(name: str, path: str) -> None:
    try:
        with open(path) as f:
            spec = f.read().strip()
    except OSError:
        return
    if not spec.startswith(name + ":"):
        return
    with _lock:
        count = _armed.get(spec, 0) + 1
        _armed[spec] = count
    try:
        due = int(spec.split(":")[1])
    except (IndexError, ValueError):
        return
    if count >= due:
        _die(name)


def _die(name: str) -> None:
    logging.getLogger("twophase.crash").warning("crash point %s reached: SIGKILL", name)
    os.kill(os.getpid(), signal.SIGKILL)


def stalled(name: str) -> bool:
    """Fault injection for the end-to-end tests: ``TWOPHASE_STALL=<name>[,<name>]`` makes the
    named activity hang (read once, at start-up, by the code that checks it)."""
    return name in os.environ.get("TWOPHASE_STALL", "").split(",")


def delay_point(name: str) -> None:
    """``TWOPHASE_DELAY_AT=name:n:seconds`` sleeps once, the n-th time ``name`` is passed."""
    spec = os.environ.get("TWOPHASE_DELAY_AT", "").split(":")
    if len(spec) != 3 or spec[0] != name:
        return
    key = f"_TWOPHASE_DELAY_COUNT_{name}"
    count = int(os.environ.get(key, "0")) + 1
    os.environ[key] = str(count)
    if count == int(spec[1]):
        logging.getLogger("twophase.delay").warning("delay point %s reached: %ss", name, spec[2])
        time.sleep(float(spec[2]))
