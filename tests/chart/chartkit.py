"""Helpers for the Helm chart tests: where helm and the chart are, rendering, manifest lookup.

A module of its own (not conftest.py) so test modules can import it by a unique name.
"""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "twophase"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
# "default" renders the chart with its own values.yaml only.
VARIANTS = ["default", *(p.name for p in CI_VALUES)]
RELEASE = "orders"
NAMESPACE = "data"

Manifest = dict[str, Any]


def helm_path() -> Path:
    cache = Path(os.environ.get("TWOPHASE_CACHE_DIR", Path.home() / ".cache" / "twophase"))
    return cache / "bin" / "helm"


def run_helm(helm: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm), *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


def values_args(variant: str) -> list[str]:
    return [] if variant == "default" else ["-f", str(CHART / "ci" / variant)]


def template_args(chart: Path, *extra: str) -> list[str]:
    return ["template", RELEASE, str(chart), "--namespace", NAMESPACE, *extra]


def parse(stdout: str) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(stdout) if doc]


class Renderer:
    """Runs `helm template` and caches the parsed manifests per argument list."""

    def __init__(self, helm: Path, chart: Path = CHART) -> None:
        self.helm = helm
        self.chart = chart
        self._cached: Callable[[tuple[str, ...]], list[Manifest]] = functools.lru_cache(
            maxsize=None
        )(self._render)

    def _render(self, args: tuple[str, ...]) -> list[Manifest]:
        result = run_helm(self.helm, *template_args(self.chart, *args))
        assert result.returncode == 0, f"helm template {' '.join(args)} failed:\n{result.stderr}"
        return parse(result.stdout)

    def __call__(self, *args: str) -> list[Manifest]:
        return self._cached(tuple(args))

    def variant(self, variant: str, *extra: str) -> list[Manifest]:
        return self(*values_args(variant), *extra)

    def fail(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Runs `helm template` expecting it to fail; returns the completed process."""
        result = run_helm(self.helm, *template_args(self.chart, *args))
        assert result.returncode != 0, f"helm template {' '.join(args)} unexpectedly succeeded"
        return result


def by_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


def one(manifests: list[Manifest], kind: str, name_suffix: str = "") -> Manifest:
    found = [m for m in by_kind(manifests, kind) if m["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {len(found)}"
    return found[0]


WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job", "Pod")


def pod_specs(manifests: list[Manifest]) -> Iterator[tuple[Manifest, dict[str, Any]]]:
    """(object, pod spec) for every object that runs pods."""
    for m in manifests:
        if m["kind"] == "Pod":
            yield m, m["spec"]
        elif m["kind"] in WORKLOAD_KINDS:
            yield m, m["spec"]["template"]["spec"]


def hook(manifest: Manifest) -> str | None:
    hook_value: str | None = manifest["metadata"].get("annotations", {}).get("helm.sh/hook")
    return hook_value
