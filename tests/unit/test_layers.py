"""Every import runs downward (ARCHITECTURE.md): the layer rules, checked over the source tree.

Each module is given a room (its dotted name decides which); each room lists the rooms it may
import. Every ``import`` counts -- top-level, inside a function, under ``TYPE_CHECKING`` -- because
any of them ties the lower layer to the upper one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Source folder -> the dotted name its modules have once installed. harness/, bench/ and chaos/
#: are the demo and test tooling, run from the repository and never installed.
FOLDERS = {
    "twophase": "twophase",
    "coordinator": "twophase.coordinator",
    "participants": "twophase.participants",
    "jobs": "twophase.jobs",
    "cli": "twophase.cli",
    "harness": "harness",
    "bench": "bench",
    "chaos": "chaos",
}

#: Rooms by dotted-name prefix, most specific first.
ROOMS: list[tuple[str, str]] = [
    ("twophase.participants.sdk", "sdk"),
    ("twophase.participants.sinks", "sinks"),
    ("twophase.participants.decoding", "decoding"),
    ("twophase.participants", "participants"),
    ("twophase.coordinator", "coordinator"),
    ("twophase.jobs", "jobs"),
    ("twophase.cli", "cli"),
    ("twophase", "core"),
    ("harness", "tooling"),
    ("bench", "tooling"),
    ("chaos", "tooling"),
]

#: Room -> rooms it may import (its own included). Read bottom-up: the core stands on nothing of
#: ours; the SDK on the core; a sink on the SDK and the core only (what it lacks, the SDK lacks);
#: coordinator and participants never import each other; the operator surface and the jobs sit
#: on top; the tooling may use anything installed.
ALLOWED: dict[str, set[str]] = {
    "core": {"core"},
    "sdk": {"core", "sdk"},
    "sinks": {"core", "sdk", "sinks"},
    "decoding": {"core", "sdk", "decoding"},
    "participants": {"core", "sdk", "sinks", "decoding", "participants"},
    "coordinator": {"core", "coordinator"},
    "jobs": {"core", "sdk", "participants", "jobs"},
    "cli": {"core", "sdk", "sinks", "decoding", "participants", "coordinator", "cli"},
    "tooling": {
        "core", "sdk", "sinks", "decoding", "participants", "coordinator", "jobs", "cli", "tooling"
    },
}  # fmt: skip

#: Names that exist only as source folders: imported bare, they bypass the installed namespace.
BARE = {"coordinator", "participants", "jobs", "cli"}


def room_of(module: str) -> str | None:
    for prefix, room in ROOMS:
        if module == prefix or module.startswith(prefix + "."):
            return room
    return None


def modules() -> Iterator[tuple[str, Path]]:
    for folder, dotted in FOLDERS.items():
        root = REPO / folder
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            # twophase/ links the other folders in: walk each file once, under its own folder.
            if folder == "twophase" and rel.parts[0] in BARE:
                continue
            parts = [p for p in rel.parts if p != "__init__"]
            yield ".".join([dotted, *parts]), path


def imports(module: str, source: str, *, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import statement, relative ones resolved."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            # `from twophase.participants import sdk` imports twophase.participants.sdk: judge
            # the names imported, not only the package they come from.
            for alias in node.names:
                yield node.lineno, f"{name}.{alias.name}" if alias.name != "*" else name


def violations(module: str, source: str, *, is_package: bool = False) -> list[str]:
    mine = room_of(module)
    assert mine is not None, module
    found = []
    for line, name in imports(module, source, is_package=is_package):
        top = name.split(".")[0]
        if top in BARE:
            found.append(f"{module}:{line} imports {name} bare: import twophase.{name}")
            continue
        theirs = room_of(name)
        if theirs is not None and theirs not in ALLOWED[mine]:
            found.append(f"{module}:{line} imports {name} ({mine} -> {theirs})")
    return found


def test_every_import_runs_downward() -> None:
    found = []
    for module, path in modules():
        found += violations(module, path.read_text(), is_package=path.name == "__init__.py")
    assert not found, "imports that run back up (see ARCHITECTURE.md):\n" + "\n".join(found)


def test_the_tests_import_the_product_the_way_users_do() -> None:
    found = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for line, name in imports("tests.x", path.read_text(), is_package=False):
            if name.split(".")[0] in BARE:
                found.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert not found, "\n".join(found)


def test_every_module_has_a_room() -> None:
    assert [m for m, _ in modules() if room_of(m) is None] == []
    assert sum(1 for _ in modules()) > 60


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("twophase.kafka", "from twophase.participants.sdk import Sink", "core -> sdk"),
        ("twophase.config", "def f():\n    import twophase.cli.main", "core -> cli"),
        ("twophase.participants.sinks.files", "from twophase.participants import runtime", "sinks -> participants"),
        ("twophase.participants.sdk.sink", "from ..runtime import batch", "sdk -> participants"),
        ("twophase.coordinator.runtime", "from twophase.participants.machine import X", "coordinator -> participants"),
        ("twophase.participants.spark", "from coordinator.machine import X", "bare"),
        ("twophase.participants.sinks.files.sink", "from twophase.participants import runtime", "sinks -> participants"),
        ("twophase.cli.txn", "from harness import Cluster", "cli -> tooling"),
    ],
)  # fmt: skip
def test_the_rule_catches_an_upward_import(module: str, source: str, expected: str) -> None:
    found = violations(module, source)
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("twophase.participants.sinks.files", "from twophase.participants.sdk import Sink"),
        ("twophase.cli.main", "from twophase.coordinator.runtime import CoordinatorRuntime"),
        ("twophase.participants.runtime.batch", "from ..sdk import records"),
        ("twophase.kafka", "from twophase.protocol import codec"),
        ("twophase.participants.sinks.files.sink", "from twophase.participants import sdk"),
    ],
)
def test_the_rule_lets_a_downward_import_through(module: str, source: str) -> None:
    assert violations(module, source) == []
