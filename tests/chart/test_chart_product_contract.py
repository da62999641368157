"""The chart against the product it deploys: the rendered config passes `twophase validate`,
and every command the chart runs exists in the `twophase` CLI of this checkout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from chartkit import (
    CHART,
    CI_VALUES,
    REPO,
    Renderer,
    one,
    parse,
    pod_specs,
    run_helm,
    template_args,
)

# Stand-ins for what the Secrets would hold; only their shape matters to validation.
DUMMY_SECRETS = {
    "TWOPHASE_MONGO_URI": "mongodb://mongo-0.mongo:27017/?replicaSet=rs0",
}


def twophase_cli() -> Path:
    cli = Path(sys.executable).parent / "twophase"
    if not cli.exists():
        pytest.fail(f"no twophase console script next to {sys.executable}; run `make venv`")
    return cli


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(twophase_cli()), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("values", [p.name for p in CI_VALUES])
def test_rendered_pipeline_config_passes_twophase_validate(
    render: Renderer, values: str, tmp_path: Path
) -> None:
    manifests = render.variant(values)
    text = one(manifests, "ConfigMap", "-pipeline")["data"]["pipeline.yaml"]
    config_file = tmp_path / "pipeline.yaml"
    config_file.write_text(text)
    # The env the pods get from their Secrets.
    (_, spec) = next(pod_specs([one(manifests, "Deployment", "-coordinator")]))
    env = {
        e["name"]: DUMMY_SECRETS.get(e["name"], "not-a-real-secret")
        for e in spec["containers"][0]["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    result = run_cli("validate", str(config_file), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok" in result.stdout


def chart_commands(render: Renderer) -> set[tuple[str, ...]]:
    """The subcommands (args before the config path) of every container the chart runs."""
    manifests = render.variant("full-values.yaml")
    commands = set()
    for _, spec in pod_specs(manifests):
        for c in spec["containers"]:
            args = c["args"]
            assert args[-1] == "/etc/twophase/pipeline.yaml"
            commands.add(tuple(args[:-1]))
    return commands


def test_chart_runs_exactly_the_contract_commands(render: Renderer) -> None:
    assert chart_commands(render) == {
        ("coordinator", "run"),
        ("participant", "run"),
        ("topics", "create"),
        ("status",),
    }


@pytest.mark.parametrize(
    "command",
    [
        ("coordinator", "run"),
        ("participant", "run"),
        ("topics", "create"),
        ("status",),
        ("validate",),
    ],
    ids=" ".join,
)
def test_cli_has_every_command_the_chart_and_docs_use(command: tuple[str, ...]) -> None:
    result = run_cli(*command, "--help")
    assert result.returncode == 0, f"`twophase {' '.join(command)}` is missing:\n{result.stderr}"
    # Each takes the config path as its one argument.
    assert re.search(r"Usage: twophase .*CONFIG", result.stdout), result.stdout


def test_participant_id_comes_from_the_env_the_chart_sets(render: Renderer) -> None:
    from twophase.config import parse_config

    text = one(render.variant("minimal-values.yaml"), "ConfigMap", "-pipeline")["data"][
        "pipeline.yaml"
    ]
    raw = yaml.safe_load(text)
    saved = dict(os.environ)
    try:
        os.environ["TWOPHASE_PG_PASSWORD"] = "x"
        os.environ["TWOPHASE_PARTICIPANT_ID"] = "orders-twophase-participant-2"
        config = parse_config(raw, env={})
        assert config.participant_id == "orders-twophase-participant-2"
        assert config.metrics.port == 9400
    finally:
        os.environ.clear()
        os.environ.update(saved)


def docs_values() -> str:
    """The values example in docs/helm.md (the YAML block that starts with its file name)."""
    text = (REPO / "docs" / "helm.md").read_text()
    blocks = re.findall(r"```yaml\n(# orders-values\.yaml\n.*?)```", text, flags=re.S)
    assert len(blocks) == 1, "docs/helm.md must keep one `# orders-values.yaml` example"
    return blocks[0]


def test_docs_example_renders_validates_and_passes_twophase_validate(
    helm: Path, tmp_path: Path
) -> None:
    values_file = tmp_path / "orders-values.yaml"
    values_file.write_text(docs_values())
    result = run_helm(helm, *template_args(CHART, "-f", str(values_file)))
    assert result.returncode == 0, result.stderr
    manifests = parse(result.stdout)
    for m in manifests:
        if m["apiVersion"] != "monitoring.coreos.com/v1":
            kubernetes_validate.validate(m, "1.36.0", strict=True)
    config_file = tmp_path / "pipeline.yaml"
    config_file.write_text(one(manifests, "ConfigMap", "-pipeline")["data"]["pipeline.yaml"])
    env = {
        name: DUMMY_SECRETS.get(name, "x")
        for name in re.findall(r"\$\{ENV:(\w+)\}", config_file.read_text())
    }
    validated = run_cli("validate", str(config_file), env=env)
    assert validated.returncode == 0, validated.stdout + validated.stderr
