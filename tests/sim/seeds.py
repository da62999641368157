"""Running a simulator over many seeds: the report a failing test prints, and the command line
of both simulators (``python -m tests.sim.world`` and ``python -m tests.sim.spark_world``)."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["assert_seeds_pass", "failures", "main", "play", "repro_command", "report"]


class Outcome(Protocol):
    seed: int
    ok: bool
    error: str
    trace: list[str]

    def summary(self) -> str: ...


Run = Callable[..., Outcome]  # run(seed, verbose=False, wire=False)


def repro_command(module: str, seed: int, wire: bool = False) -> str:
    """The command that replays one seed of the simulator ``module`` with a trace."""
    return f".venv/bin/python -m {module} --seed {seed} --verbose{' --wire' if wire else ''}"


def play(world: Any, violation: type[Exception]) -> str:
    """Run ``world`` through its fault phase, quiescence and checks; what went wrong, or ""."""
    try:
        for _ in range(world.p.fault_steps):
            world.step()
        world.quiesce()
        world.check()
    except violation as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - a crash inside a machine is a finding too
        import traceback

        return "exception: " + "".join(traceback.format_exception(exc)).strip()
    return ""


def _verdict(run: Run, job: tuple[int, bool]) -> tuple[int, str]:
    seed, wire = job
    res = run(seed, wire=wire)
    return seed, "" if res.ok else res.error.splitlines()[0][:300]


def failures(module: str, run: Run, seeds: range, wire: bool = False) -> list[str]:
    """One line per failing seed: the command that replays it, and the first line of why."""
    return [
        f"{repro_command(module, seed, wire)}   # {error}"
        for seed, error in (_verdict(run, (s, wire)) for s in seeds)
        if error
    ]


def report(bad: list[str], total: int) -> str:
    shown = "\n".join(bad[:10])
    more = f"\n... and {len(bad) - 10} more" if len(bad) > 10 else ""
    return f"{len(bad)}/{total} schedules broke a guarantee; replay one with:\n{shown}{more}"


def assert_seeds_pass(module: str, run: Run, seeds: range, wire: bool = False) -> None:
    bad = failures(module, run, seeds, wire)
    assert not bad, report(bad, len(seeds))


def main(doc: str | None, module: str, run: Run, argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0] if doc else None)
    ap.add_argument("--seed", type=int, help="run one schedule")
    ap.add_argument("--seeds", help="run a range of schedules, e.g. 0:1000")
    ap.add_argument("--jobs", type=int, default=1, help="processes for --seeds")
    ap.add_argument("--verbose", action="store_true", help="print the trace")
    ap.add_argument("--wire", action="store_true", help="round-trip every message via the codec")
    args = ap.parse_args(argv)
    if args.seed is not None:
        res = run(args.seed, verbose=args.verbose, wire=args.wire)
        if args.verbose:
            print("\n".join(res.trace))
        print(f"seed {res.seed}: {'ok' if res.ok else 'FAILED'} {res.summary()}")
        if not res.ok:
            print(res.error)
        return 0 if res.ok else 1
    lo, hi = (int(x) for x in (args.seeds or "0:1000").split(":"))
    jobs = [(seed, args.wire) for seed in range(lo, hi)]
    verdict = functools.partial(_verdict, run)
    if args.jobs > 1:
        import multiprocessing

        with multiprocessing.Pool(args.jobs) as pool:
            verdicts = list(pool.imap(verdict, jobs, chunksize=200))
    else:
        verdicts = [verdict(j) for j in jobs]
    bad = [(seed, err) for seed, err in verdicts if err]
    for seed, err in bad:
        print(f"{repro_command(module, seed, args.wire)}  # {err}")
    print(f"{hi - lo - len(bad)}/{hi - lo} schedules passed")
    return 1 if bad else 0
