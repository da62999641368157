"""Rules for the suite itself: what one test must not do to the process every test shares.

The suite runs in one process that keeps threads between tests -- py4j's finalizer of the
session's Spark gateway, pymongo's monitors, a runtime a test runs in a thread. A test that
replaces a function of the ``time`` module replaces it for all of them: a ``time.sleep`` that
returns at once turns each of their sleep loops into a spin (CI: the suite's process grew to
20 GB inside one unit test and the kernel killed it). ``recorded_sleeps`` (tests/conftest.py)
records the test thread's sleeps and lets every other thread sleep.
"""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Where a process-wide replacement of a ``time`` function may be made: the fixture that
#: replaces it for the test's own thread only.
ALLOWED = {("tests/conftest.py", "recorded_sleeps")}


def _time_patches(source: str) -> list[tuple[int, str]]:
    """(line, enclosing function) of each process-wide replacement of a ``time`` function:
    ``setattr(time, ...)`` (monkeypatch's or the builtin), ``setattr("time.x", ...)``,
    ``patch("time.x")`` / ``patch.object(time, ...)``, and ``time.x = ...``."""
    tree = ast.parse(source)
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef) else func
            if isinstance(child, ast.Call):
                name = (
                    child.func.attr
                    if isinstance(child.func, ast.Attribute)
                    else (child.func.id if isinstance(child.func, ast.Name) else "")
                )
                first = child.args[0] if child.args else None
                module = isinstance(first, ast.Name) and first.id == "time"
                dotted = (
                    isinstance(first, ast.Constant)
                    and isinstance(first.value, str)
                    and first.value.startswith("time.")
                )
                if (name in {"setattr", "object"} and module) or (
                    name in {"setattr", "patch"} and dotted
                ):
                    found.append((child.lineno, func))
            if isinstance(child, ast.Assign):
                for target in child.targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "time"
                    ):
                        found.append((child.lineno, func))
            visit(child, inner)

    visit(tree, "")
    return found


def _suite_files() -> list[Path]:
    roots = [ROOT / "tests", ROOT / "harness", *sorted((ROOT / "examples").glob("*/tests"))]
    return [p for r in roots for p in sorted(r.rglob("*.py"))]


def test_no_test_replaces_a_time_function_for_the_whole_process() -> None:
    offenders = []
    for path in _suite_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, func in _time_patches(path.read_text()):
            if (rel, func) not in ALLOWED:
                offenders.append(f"{rel}:{line} (in {func or 'the module'})")
    assert not offenders, (
        "these replace a `time` function for every thread of the suite's process; "
        f"use the recorded_sleeps fixture: {offenders}"
    )


def test_the_rule_sees_each_form_of_the_patch() -> None:
    forms = [
        "monkeypatch.setattr(time, 'sleep', lambda s: None)",
        "setattr(time, 'monotonic', lambda: 0.0)",
        "monkeypatch.setattr('time.sleep', print)",
        "mock.patch('time.time', return_value=0)",
        "mock.patch.object(time, 'sleep')",
        "time.sleep = print",
    ]
    for form in forms:
        assert _time_patches(f"def f():\n    {form}\n") == [(2, "f")], form
    assert _time_patches("monkeypatch.setattr(clock, 'sleep', print)\ntime.sleep(0)\n") == []
    for rel, func in ALLOWED:  # a stale exception would let the next one through
        assert func in {f for _, f in _time_patches((ROOT / rel).read_text())}, (rel, func)


def test_recorded_sleeps_records_the_test_thread_and_lets_others_sleep(
    recorded_sleeps: list[float],
) -> None:
    time.sleep(7.5)  # recorded, not slept
    slept: list[float] = []

    def other() -> None:
        start = time.monotonic()
        time.sleep(0.05)
        slept.append(time.monotonic() - start)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(5)
    assert recorded_sleeps == [7.5]
    assert slept and slept[0] >= 0.05, slept
