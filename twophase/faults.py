"""Fault injection for the chaos run and the end-to-end tests (no effect unless armed by env).

``TWOPHASE_CRASH_AT=<name>:<n>`` kills the process (SIGKILL, no clean-up) the n-th time it passes
``crash_point(name)``. Participant points: before_vote, after_vote, after_prepare, before_commit,
mid_commit (after each sink of a commit). Coordinator points: after_prepare_sent, mid_decision
(DECISION produced, its Kafka transaction not committed), after_decision (committed).
"""

from __future__ import annotations

import logging
import os
import signal

__all__ = ["crash_point"]


def crash_point(name: str) -> None:
    """Fault injection for the chaos and end-to-end tests: ``TWOPHASE_CRASH_AT=name:n`` kills the
    process (SIGKILL, no clean-up) the n-th time it passes ``name``."""
    spec = os.environ.get("TWOPHASE_CRASH_AT", "")
    if not spec.startswith(name + ":"):
        return
    count = int(os.environ.get("_TWOPHASE_CRASH_COUNT", "0")) + 1
    os.environ["_TWOPHASE_CRASH_COUNT"] = str(count)
    if count >= int(spec.split(":", 1)[1]):
        logging.getLogger("twophase.crash").warning("crash point %s reached: SIGKILL", name)
        os.kill(os.getpid(), signal.SIGKILL)
