"""Fixtures for the Helm chart tests: a real helm binary and cached renders of the chart."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from chartkit import CHART, Renderer, helm_path


@pytest.fixture(scope="session")
def helm() -> Path:
    path = helm_path()
    if not os.access(path, os.X_OK):
        # Fail, never skip: a chart test that silently does not run is a defect.
        pytest.fail(f"helm not found at {path}; run `make helm` (bash stack/helm.sh) first")
    return path


@pytest.fixture(scope="session")
def render(helm: Path) -> Renderer:
    return Renderer(helm)


@pytest.fixture
def chart_copy(tmp_path: Path) -> Iterator[Path]:
    """A private copy of the chart that a test may modify."""
    dest = tmp_path / "twophase"
    shutil.copytree(CHART, dest)
    yield dest
