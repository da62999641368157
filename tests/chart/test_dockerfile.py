"""The Dockerfile, checked by inspection (no container engine here; hadolint is not on PyPI).

Also checks that the image and the chart agree: user id, port, entrypoint, config path.
"""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from dataclasses import dataclass

import pytest
import yaml
from chartkit import CHART, REPO

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"


@dataclass
class Instruction:
    op: str
    args: str


def instructions() -> list[Instruction]:
    """Instructions with line continuations joined and comments dropped."""
    out: list[Instruction] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        op, _, args = full.partition(" ")
        out.append(Instruction(op.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a line continuation"
    return out


def stages() -> list[list[Instruction]]:
    """Instructions per build stage; stage 0 is the global ARGs before the first FROM."""
    result: list[list[Instruction]] = [[]]
    for ins in instructions():
        if ins.op == "FROM":
            result.append([])
        result[-1].append(ins)
    return result


def global_args() -> dict[str, str]:
    args = {}
    for ins in stages()[0]:
        assert ins.op == "ARG", f"only ARG may precede the first FROM, got {ins.op}"
        name, _, default = ins.args.partition("=")
        args[name] = default
    return args


def base_images() -> list[str]:
    images = []
    for stage in stages()[1:]:
        image = stage[0].args.split()[0]
        images.append(re.sub(r"\$\{(\w+)\}", lambda m: global_args()[m.group(1)], image))
    return images


def final_stage() -> list[Instruction]:
    return stages()[-1]


def test_base_image_is_pinned_python_311_slim() -> None:
    for image in base_images():
        assert re.fullmatch(
            r"python:3\.11\.\d+-slim-(bookworm|trixie)(@sha256:[0-9a-f]{64})?", image
        ), f"base image {image!r} must pin an exact Python 3.11 patch release and Debian release"
        assert not image.endswith(":latest")


def test_runs_as_the_non_root_user_the_chart_expects() -> None:
    users = [ins.args for ins in final_stage() if ins.op == "USER"]
    assert users, "the final stage must set USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric non-root USER, so runAsNonRoot can verify it"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert (
        int(uid)
        == values["securityContext"]["runAsUser"]
        == values["podSecurityContext"]["runAsUser"]
        == 10001
    )
    assert gid and int(gid) == values["podSecurityContext"]["fsGroup"]


def test_entrypoint_is_the_twophase_console_script() -> None:
    (entrypoint,) = [ins.args for ins in final_stage() if ins.op == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["twophase"], "exec form, so signals reach twophase"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["twophase"]


def test_exposes_the_chart_http_port() -> None:
    exposed = {
        int(p.split("/")[0])
        for ins in final_stage()
        if ins.op == "EXPOSE"
        for p in ins.args.split()
    }
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["metrics"]["port"] in exposed


def test_no_spark_and_no_dev_extras_in_the_image() -> None:
    runs = " ".join(ins.args for ins in instructions() if ins.op == "RUN")
    assert "pip install ." in runs
    assert "pyspark" not in runs and "[spark" not in runs and "[dev" not in runs


def test_no_remote_add_and_no_root_switch_back() -> None:
    for ins in instructions():
        assert ins.op != "ADD", "COPY, not ADD: no remote URLs or implicit unpacking"
    final_ops = [ins.op for ins in final_stage()]
    assert final_ops.index("USER") > max(
        i for i, op in enumerate(final_ops) if op in ("RUN", "COPY")
    )


def dockerignore_patterns() -> list[str]:
    return [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


def in_build_context(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    included = True
    for pattern in dockerignore_patterns():
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/").removeprefix("**/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pat) for p in prefixes) or fnmatch.fnmatch(parts[-1], pat):
            included = negate
    return included


def copy_sources() -> list[str]:
    sources = []
    for ins in instructions():
        if ins.op == "COPY" and "--from=" not in ins.args:
            sources += ins.args.split()[:-1]
    return sources


@pytest.mark.parametrize("source", copy_sources())
def test_copied_sources_exist_and_are_in_the_build_context(source: str) -> None:
    assert (REPO / source).exists(), f"COPY {source}: no such path in the repo"
    assert in_build_context(source), f"COPY {source}: excluded by .dockerignore"


def test_wheel_inputs_are_all_copied() -> None:
    """What pyproject builds into the wheel must be in the image build."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    wheel = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]
    needed = set(wheel["packages"]) | {p.split("/")[0] for p in wheel.get("force-include", {})}
    needed.add(pyproject["project"]["readme"])
    copied = {s.rstrip("/").split("/")[0] for s in copy_sources()}
    assert needed <= copied, f"not copied: {sorted(needed - copied)}"


@pytest.mark.parametrize(
    "path",
    [
        ".venv/bin/python",
        ".cache/bin/helm",
        ".git/config",
        ".stack/kafka/data",
        "tests/chart/conftest.py",
        "charts/twophase/values.yaml",
    ],
)
def test_local_state_stays_out_of_the_build_context(path: str) -> None:
    assert not in_build_context(path)


def test_chart_commands_use_the_image_entrypoint() -> None:
    """The chart passes only args; the command comes from ENTRYPOINT."""
    for template in (CHART / "templates").rglob("*.yaml"):
        text = template.read_text()
        assert "command:" not in text, f"{template.name} overrides the image ENTRYPOINT"
