"""Installed the way users install it: ``pip install .`` into a clean venv, one namespace.

The source tree keeps the top-level folders (coordinator/, participants/, jobs/, cli/), but the
wheel puts only ``twophase`` into site-packages: no generic ``coordinator`` or ``jobs`` package
to collide with a user's own, and none of the demo/test tooling (harness/, bench/, chaos/).
"""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: pip resolves and unpacks every dependency (pyarrow, confluent-kafka, ...) from its cache,
#: which `make venv` filled: a minute or two on this machine, more on a cold cache.
INSTALL_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("clean-venv")
    venv.create(root, with_pip=True)
    subprocess.run(
        # pytest too: a sink author's tests load the conformance kit's plugin with it.
        [str(root / "bin" / "python"), "-m", "pip", "install", "--quiet", str(REPO), "pytest"],
        check=True,
        timeout=INSTALL_TIMEOUT_S,
        cwd=root,
    )
    return root


def _run(venv_root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # cwd is the venv, never the repository: nothing is importable by accident.
    return subprocess.run(
        list(args), capture_output=True, text=True, timeout=120, cwd=venv_root, check=False
    )


def test_everything_imports_under_twophase(clean_venv: Path) -> None:
    py = str(clean_venv / "bin" / "python")
    for module in (
        "twophase.participants",
        "twophase.participants.sdk",
        "twophase.participants.sinks.postgres",
        "twophase.coordinator.machine",
        "twophase.jobs.session",
        "twophase.cli.main",
        "twophase.participants.sdk.testkit.plugin",
    ):
        done = _run(clean_venv, py, "-c", f"import {module}")
        assert done.returncode == 0, f"import {module}: {done.stderr}"


@pytest.mark.parametrize("bare", ["participants", "coordinator", "jobs", "cli", "harness", "bench"])
def test_no_generic_top_level_package_is_installed(clean_venv: Path, bare: str) -> None:
    done = _run(clean_venv, str(clean_venv / "bin" / "python"), "-c", f"import {bare}")
    assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr, done


def test_the_wheel_holds_only_the_twophase_package(clean_venv: Path) -> None:
    (record,) = clean_venv.glob("lib/python*/site-packages/twophase-*.dist-info/RECORD")
    tops = {line.split(",")[0].split("/")[0] for line in record.read_text().splitlines()}
    assert tops - {"twophase", record.parent.name, ".."} == set(), tops


def test_the_cli_and_its_entry_points_work(clean_venv: Path) -> None:
    cli = str(clean_venv / "bin" / "twophase")
    done = _run(clean_venv, cli, "--help")
    assert done.returncode == 0 and "coordinator" in done.stdout, done
    listed = json.loads(_run(clean_venv, cli, "sinks", "list", "--json").stdout)
    assert {"postgres", "mongodb", "files"} <= set(listed), listed
    # The pytest plugin entry point (the sink conformance kit) loads from the installed package.
    plugin = _run(
        clean_venv,
        str(clean_venv / "bin" / "python"),
        "-c",
        "from importlib.metadata import entry_points; "
        "(ep,) = entry_points(group='pytest11', name='twophase_sinkkit'); print(ep.load().__name__)",
    )
    assert plugin.stdout.strip() == "twophase.participants.sdk.testkit.plugin", plugin


def test_the_source_tree_is_not_what_python_imports() -> None:
    """In the dev venv too, the product is found through twophase/, not the bare folders."""
    import twophase.participants.sdk as sdk

    assert Path(sdk.__file__).parts[-4:-1] == ("twophase", "participants", "sdk"), sdk.__file__
    assert sys.modules.get("participants") is None
