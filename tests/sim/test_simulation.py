"""Thousands of random schedules through the real state machines; every one must keep the
guarantees. A failing seed is reported with the one command that replays it with a trace.

``TWOPHASE_SIM_SEED_BASE`` shifts the seed range (to explore new schedules locally); CI keeps
the default so a red run always names seeds anyone can replay.
"""

from __future__ import annotations

import os

import pytest

from .world import repro_command, run

CHUNKS = 20
PER_CHUNK = 500
BASE = int(os.environ.get("TWOPHASE_SIM_SEED_BASE", "0"))
#: Codec round trips validate every message against the JSON Schemas: ~10x slower, so fewer.
WIRE_SEEDS = 100
WIRE_BASE = 1_000_000


def _failures(seeds: range, wire: bool = False) -> list[str]:
    bad = []
    for seed in seeds:
        res = run(seed, wire=wire)
        if not res.ok:
            first = res.error.splitlines()[0] if res.error else "?"
            bad.append(f"{repro_command(seed, wire)}   # {first[:300]}")
    return bad


def _report(bad: list[str], total: int) -> str:
    shown = "\n".join(bad[:10])
    more = f"\n... and {len(bad) - 10} more" if len(bad) > 10 else ""
    return f"{len(bad)}/{total} schedules broke a guarantee; replay one with:\n{shown}{more}"


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_schedules(chunk: int) -> None:
    seeds = range(BASE + chunk * PER_CHUNK, BASE + (chunk + 1) * PER_CHUNK)
    bad = _failures(seeds)
    assert not bad, _report(bad, len(seeds))


def test_random_schedules_through_the_codec() -> None:
    """Every message encoded (schema-validated) and decoded again on each delivery."""
    seeds = range(WIRE_BASE + BASE, WIRE_BASE + BASE + WIRE_SEEDS)
    bad = _failures(seeds, wire=True)
    assert not bad, _report(bad, len(seeds))


def test_a_seed_replays_exactly() -> None:
    """Determinism is what makes a printed seed worth anything."""
    a = run(4242, verbose=True)
    b = run(4242, verbose=True)
    assert a.trace == b.trace and len(a.trace) > 100
