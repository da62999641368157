"""Values in, config out: the schema, the pipeline config, secret handling and NOTES.txt."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from chartkit import (
    CHART,
    RELEASE,
    VARIANTS,
    Manifest,
    Renderer,
    one,
    pod_specs,
    run_helm,
    template_args,
)

REFERENCE = re.compile(r"^\$\{(ENV|FILE):([^}]+)\}$")
SECRET_KEYS = {"password", "hmac_key", "sasl.password", "sasl.username", "uri"}


def pipeline_config(manifests: list[Manifest]) -> dict[str, Any]:
    config_map = one(manifests, "ConfigMap", "-pipeline")
    config: dict[str, Any] = yaml.safe_load(config_map["data"]["pipeline.yaml"])
    return config


def walk(value: Any, path: str = "") -> list[tuple[str, str, Any]]:
    """(path, key, value) for every mapping entry, depth first."""
    out: list[tuple[str, str, Any]] = []
    if isinstance(value, dict):
        for k, v in value.items():
            out.append((f"{path}.{k}", k, v))
            out.extend(walk(v, f"{path}.{k}"))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.extend(walk(v, f"{path}[{i}]"))
    return out


# --- the schema ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "field", "why"),
    [
        (
            ["--set", "coordinator.replicas=abc"],
            "/coordinator/replicas",
            "got string, want integer",
        ),
        (["--set", "participant.replicas=-1"], "/participant/replicas", "minimum: got -1, want 0"),
        (
            ["--set", "participant.kind=DaemonSet"],
            "/participant/kind",
            "value must be one of 'StatefulSet', 'Deployment'",
        ),
        (
            ["--set", "kafka.securityProtocol=SSL_SASL"],
            "/kafka/securityProtocol",
            "value must be one of",
        ),
        (
            ["--set", "coordinator.replicaz=2"],
            "/coordinator",
            "additional properties 'replicaz' not allowed",
        ),
        (["--set", "metrics.port=70000"], "/metrics/port", "maximum"),
        (
            ["--set", "coordinator.livenessProbe.enabled=yes"],
            "/coordinator/livenessProbe/enabled",
            "got string, want boolean",
        ),
        (
            ["--set", "metrics.serviceMonitor.interval=often"],
            "/metrics/serviceMonitor/interval",
            "'often' does not match pattern",
        ),
        (
            ["--set", "participant.podDisruptionBudget.maxUnavailable=half"],
            "/participant/podDisruptionBudget/maxUnavailable",
            "'half' does not match pattern",
        ),
        (
            ["--set-string", "pipeline.sources=orders"],
            "/pipeline/sources",
            "got string, want array",
        ),
    ],
)
def test_schema_rejects_bad_values_naming_the_field(
    render: Renderer, args: list[str], field: str, why: str
) -> None:
    result = render.fail(*args)
    assert "values don't meet the specifications of the schema" in result.stderr
    assert field in result.stderr, result.stderr
    assert why in result.stderr, result.stderr


def schema_paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    paths = set()
    for key, sub in schema.get("properties", {}).items():
        paths.add(prefix + key)
        paths |= schema_paths(sub, prefix + key + ".")
    return paths


def value_paths(values: dict[str, Any], prefix: str = "") -> set[str]:
    paths = set()
    for key, sub in values.items():
        paths.add(prefix + key)
        if isinstance(sub, dict) and sub and key != "pipeline":
            paths |= value_paths(sub, prefix + key + ".")
    return paths


# Maps whose keys are the user's own (label names, resource names, librdkafka settings).
FREE_FORM_MAPS = (
    "resources.",
    "Labels.",
    "Annotations.",
    "annotations.",
    "labels.",
    "nodeSelector.",
    "affinity.",
    "kafka.config.",
    "podSecurityContext.seccompProfile.",
    "securityContext.seccompProfile.",
)


def test_schema_covers_every_value() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    declared = schema_paths(schema)
    undeclared = {
        p for p in value_paths(values) - declared if not any(f in p for f in FREE_FORM_MAPS)
    }
    assert not undeclared, f"values without a schema: {sorted(undeclared)}"
    assert schema["additionalProperties"] is False


def test_schema_closes_every_object_except_free_form_ones() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())

    def open_objects(node: dict[str, Any], path: str) -> list[str]:
        found = []
        if node.get("properties") and node.get("additionalProperties") is not False:
            found.append(path)
        for key, sub in node.get("properties", {}).items():
            found += open_objects(sub, f"{path}.{key}")
        return found

    assert open_objects(schema, "") == [".pipeline"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_ci_values_pass_the_schema_and_only_use_known_keys(helm: Path, variant: str) -> None:
    # helm lint checks the schema too; this names the failing variant on its own.
    result = run_helm(
        helm,
        *template_args(
            CHART, *(["-f", str(CHART / "ci" / variant)] if variant != "default" else [])
        ),
    )
    assert result.returncode == 0, result.stderr


# --- the pipeline config -----------------------------------------------------------------


def test_pipeline_name_defaults_to_release(render: Renderer) -> None:
    assert pipeline_config(render())["pipeline"] == RELEASE
    assert pipeline_config(render.variant("minimal-values.yaml"))["pipeline"] == "orders"


def test_user_pipeline_passes_through(render: Renderer) -> None:
    values = yaml.safe_load((CHART / "ci" / "full-values.yaml").read_text())["pipeline"]
    config = pipeline_config(render.variant("full-values.yaml"))
    for key in ("sources", "sinks", "dead_letter", "commit"):  # untouched by the chart
        assert config[key] == values[key]
    assert config["control"]["topic"] == "twophase.control.orders"


def test_kafka_settings_merge_into_the_config(render: Renderer) -> None:
    kafka = pipeline_config(render.variant("full-values.yaml"))["kafka"]
    assert kafka["bootstrap_servers"] == "b-1.kafka.example.com:9096,b-2.kafka.example.com:9096"
    assert kafka["config"] == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "${ENV:TWOPHASE_KAFKA_SASL_USERNAME}",
        "sasl.password": "${ENV:TWOPHASE_KAFKA_SASL_PASSWORD}",
        "ssl.ca.location": "/etc/twophase/tls/ca.crt",
        "ssl.certificate.location": "/etc/twophase/tls/tls.crt",
        "ssl.key.location": "/etc/twophase/tls/tls.key",
        # kafka.config passthrough
        "client.id": "twophase-orders",
        "ssl.endpoint.identification.algorithm": "https",
        "socket.keepalive.enable": True,
    }


def test_plaintext_has_no_sasl_or_tls(render: Renderer) -> None:
    config = pipeline_config(render())
    assert config["kafka"]["config"] == {"security.protocol": "PLAINTEXT"}
    assert config["metrics"] == {"port": 9400}


def test_chart_kafka_values_win_over_pipeline_kafka_but_passthrough_wins_over_all(
    render: Renderer,
) -> None:
    config = pipeline_config(
        render(
            "--set",
            "pipeline.kafka.bootstrap_servers=stale:9092",
            "--set",
            "pipeline.kafka.config.linger\\.ms=5",
            "--set",
            "pipeline.kafka.config.security\\.protocol=SSL",
            "--set",
            "kafka.bootstrapServers=fresh:9092",
            "--set",
            "kafka.config.linger\\.ms=20",
        )
    )
    assert config["kafka"]["bootstrap_servers"] == "fresh:9092"
    assert config["kafka"]["config"]["security.protocol"] == "PLAINTEXT"
    assert config["kafka"]["config"]["linger.ms"] == 20


def test_hmac_key_reference_added_only_when_its_secret_is_set(render: Renderer) -> None:
    assert "control" not in pipeline_config(render())
    config = pipeline_config(render("--set", "secrets.controlHmacKey.existingSecret=hmac"))
    assert config["control"] == {"hmac_key": "${ENV:TWOPHASE_CONTROL_HMAC_KEY}"}


# --- secrets -------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_configmap_holds_only_secret_references(render: Renderer, variant: str) -> None:
    manifests = render.variant(variant)
    assert not [m for m in manifests if m["kind"] == "Secret"], "the chart never creates Secrets"
    for path, key, value in walk(pipeline_config(manifests)):
        if key.lower() in SECRET_KEYS and isinstance(value, str) and "://" not in value:
            assert REFERENCE.match(value), f"{path} = {value!r} is not a reference"
        if isinstance(value, str):
            assert not re.search(r"://[^/@]*:[^/@$]+@", value), f"{path} has a password in a URL"


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_env_reference_is_defined_in_every_container(render: Renderer, variant: str) -> None:
    """${ENV:X} in the config must resolve in the coordinator, participants, hook and test pod."""
    manifests = render.variant(variant)
    text = one(manifests, "ConfigMap", "-pipeline")["data"]["pipeline.yaml"]
    wanted = set(re.findall(r"\$\{ENV:([A-Za-z_][A-Za-z0-9_]*)\}", text))
    files = set(re.findall(r"\$\{FILE:([^}]+)\}", text))
    config = yaml.safe_load(text)
    locations = {v for _, k, v in walk(config) if k.endswith(".location")}
    for m, spec in pod_specs(manifests):
        for c in spec["containers"]:
            where = f"{m['kind']}/{m['metadata']['name']}"
            env = {e["name"] for e in c["env"]}
            assert wanted <= env, f"{where} lacks {sorted(wanted - env)}"
            mounts = [vm["mountPath"].rstrip("/") + "/" for vm in c["volumeMounts"]]
            for path in files | locations:
                assert any(path.startswith(m) for m in mounts), f"{where}: {path} is not mounted"


def test_secret_env_comes_from_the_named_secrets(render: Renderer) -> None:
    (c,) = one(render.variant("full-values.yaml"), "Deployment")["spec"]["template"]["spec"][
        "containers"
    ]
    refs = {
        e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for e in c["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert refs == {
        "TWOPHASE_KAFKA_SASL_USERNAME": ("orders-kafka-sasl", "username"),
        "TWOPHASE_KAFKA_SASL_PASSWORD": ("orders-kafka-sasl", "password"),
        "TWOPHASE_CONTROL_HMAC_KEY": ("orders-control", "hmac-key"),
        "TWOPHASE_PG_PASSWORD": ("orders-pg", "pg-password"),
        "TWOPHASE_MONGO_URI": ("orders-mongo", "uri"),
    }


def test_tls_secret_is_mounted_read_only_for_the_group(render: Renderer) -> None:
    spec = one(render.variant("full-values.yaml"), "Deployment")["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "kafka-tls"]
    assert volume["secret"] == {"secretName": "orders-kafka-tls", "defaultMode": 0o440}
    (c,) = spec["containers"]
    assert {"name": "kafka-tls", "mountPath": "/etc/twophase/tls", "readOnly": True} in c[
        "volumeMounts"
    ]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--set", "pipeline.sinks[0].password=hunter2"], "pipeline.sinks[0].password"),
        (["--set", "pipeline.control.hmac_key=hunter2"], "pipeline.control.hmac_key"),
        (["--set", "kafka.config.sasl\\.password=hunter2"], "kafka.config.sasl.password"),
        (
            ["--set", "pipeline.sinks[0].dsn=postgresql://app:hunter2@pg:5432/app"],
            "pipeline.sinks[0].dsn",
        ),
        (
            ["--set", "pipeline.sinks[0].uri=mongodb://app:hunter2@mongo/app"],
            "pipeline.sinks[0].uri",
        ),
        (["--set", "pipeline.sinks[0].password=${FILE:}"], "pipeline.sinks[0].password"),
    ],
)
def test_literal_secrets_are_refused(render: Renderer, args: list[str], field: str) -> None:
    result = render.fail(*args)
    assert field in result.stderr, result.stderr
    assert "hunter2" not in result.stdout


def test_secret_references_and_credential_free_urls_are_accepted(render: Renderer) -> None:
    config = pipeline_config(
        render(
            "--set",
            "pipeline.sinks[0].password=${FILE:/etc/twophase/pg/password}",
            "--set",
            "pipeline.sinks[0].dsn=postgresql://app@pg:5432/app",
            "--set",
            "pipeline.sinks[1].uri=mongodb://mongo-0.mongo:27017/?replicaSet=rs0",
            "--set",
            "pipeline.sinks[2].dsn=postgresql://app:${ENV:PG_PASSWORD}@pg/app",
        )
    )
    assert config["sinks"][0]["password"] == "${FILE:/etc/twophase/pg/password}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "image.tag=latest"], "image.tag"),
        (["--set", "kafka.securityProtocol=SASL_SSL"], "kafka.sasl.existingSecret"),
        (["--set", "kafka.tls.existingSecret=ca"], "kafka.tls.existingSecret"),
        (
            ["--set", "kafka.securityProtocol=SSL", "--set", "kafka.tls.clientAuth=true"],
            "kafka.tls.clientAuth",
        ),
        (
            [
                "--set",
                "participant.kind=Deployment",
                "--set",
                "participant.persistence.enabled=true",
            ],
            "participant.persistence.enabled",
        ),
        (
            [
                "--set",
                "metrics.service.enabled=false",
                "--set",
                "metrics.serviceMonitor.enabled=true",
            ],
            "metrics.serviceMonitor.enabled",
        ),
        (
            [
                "--set",
                "coordinator.podDisruptionBudget.enabled=true",
                "--set",
                "coordinator.podDisruptionBudget.maxUnavailable=1",
            ],
            "coordinator.podDisruptionBudget",
        ),
        (
            [
                "--set",
                "participant.autoscaling.enabled=true",
                "--set",
                "participant.autoscaling.minReplicas=9",
            ],
            "participant.autoscaling.minReplicas",
        ),
    ],
)
def test_settings_that_cannot_work_fail_at_render_time(
    render: Renderer, args: list[str], message: str
) -> None:
    assert message in render.fail(*args).stderr


# --- NOTES.txt -----------------------------------------------------------------------------


def render_notes(helm: Path, chart_copy: Path, *args: str) -> str:
    """`helm install --dry-run` needs a cluster, so render NOTES.txt as a ConfigMap value."""
    notes = chart_copy / "templates" / "NOTES.txt"
    body = notes.read_text()
    notes.unlink()
    (chart_copy / "templates" / "_notes_under_test.tpl").write_text(
        '{{- define "notes.under.test" -}}\n' + body + "\n{{- end }}\n"
    )
    (chart_copy / "templates" / "notes-under-test.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes-under-test}\n"
        'data:\n  notes: {{ include "notes.under.test" . | quote }}\n'
    )
    result = run_helm(
        helm, *template_args(chart_copy, "--show-only", "templates/notes-under-test.yaml", *args)
    )
    assert result.returncode == 0, result.stderr
    notes_text: str = yaml.safe_load(result.stdout)["data"]["notes"]
    return notes_text


def test_notes_say_what_to_do_next(helm: Path, chart_copy: Path) -> None:
    notes = render_notes(helm, chart_copy, "-f", str(CHART / "ci" / "minimal-values.yaml"))
    assert "helm test orders -n data" in notes
    assert "twophase status /etc/twophase/pipeline.yaml" in notes
    assert "port-forward svc/orders-twophase-metrics 9400:9400" in notes
    assert "/metrics" in notes
    assert 'dead-letter topic "orders.dlq"' in notes
    assert "rollout status statefulset/orders-twophase-participant" in notes
    assert "WARNING" not in notes


def test_notes_warn_about_an_empty_pipeline(helm: Path, chart_copy: Path) -> None:
    notes = render_notes(helm, chart_copy)
    assert "WARNING: `pipeline` has no sources and no sinks" in notes


def test_chart_owns_the_metrics_port_but_keeps_other_metrics_settings(render: Renderer) -> None:
    # The probes and the Service point at metrics.port, so a port set only inside `pipeline`
    # would leave them probing the wrong port.
    config = pipeline_config(
        render("--set", "pipeline.metrics.port=1234", "--set", "pipeline.metrics.host=0.0.0.0")
    )
    assert config["metrics"] == {"port": 9400, "host": "0.0.0.0"}
