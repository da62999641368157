"""What the rendered chart contains: labels, probes, optional objects, hooks, security."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from chartkit import (
    RELEASE,
    VARIANTS,
    Manifest,
    Renderer,
    by_kind,
    hook,
    one,
    parse,
    pod_specs,
    run_helm,
    template_args,
)

SELECTOR_KEYS = {
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
}


def selectors(manifests: list[Manifest]) -> dict[str, dict[str, str]]:
    """Every label selector the chart renders, keyed by where it is."""
    found: dict[str, dict[str, str]] = {}
    for m in manifests:
        where = f"{m['kind']}/{m['metadata']['name']}"
        spec = m.get("spec", {})
        if m["kind"] in ("Deployment", "StatefulSet", "PodDisruptionBudget", "ServiceMonitor"):
            found[where] = spec["selector"]["matchLabels"]
        if m["kind"] == "Service":
            found[where] = spec["selector"]
        if m["kind"] in ("Deployment", "StatefulSet"):
            for i, claim in enumerate(spec.get("volumeClaimTemplates", [])):
                found[f"{where}/volumeClaimTemplates[{i}]"] = claim["metadata"]["labels"]
            affinity = spec["template"]["spec"].get("affinity", {})
            for term in affinity.get("podAntiAffinity", {}).get(
                "preferredDuringSchedulingIgnoredDuringExecution", []
            ):
                found[f"{where}/antiAffinity"] = term["podAffinityTerm"]["labelSelector"][
                    "matchLabels"
                ]
    return found


def workload_selectors(manifests: list[Manifest]) -> dict[str, dict[str, str]]:
    return {
        m["kind"] + "/" + m["metadata"]["name"].rsplit("-", 1)[-1]: m["spec"]["selector"][
            "matchLabels"
        ]
        for m in manifests
        if m["kind"] in ("Deployment", "StatefulSet")
    }


@pytest.mark.parametrize("variant", VARIANTS)
def test_selectors_hold_only_name_instance_component(render: Renderer, variant: str) -> None:
    manifests = render.variant(variant)
    for where, labels in selectors(manifests).items():
        assert set(labels) <= SELECTOR_KEYS, f"{where} selects on {sorted(labels)}"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        for value in labels.values():
            assert "0.1.0" not in value, f"{where}: a version in a selector breaks upgrades"


@pytest.mark.parametrize("variant", VARIANTS)
def test_workload_selectors_match_their_pods(render: Renderer, variant: str) -> None:
    for m in render.variant(variant):
        if m["kind"] in ("Deployment", "StatefulSet"):
            pod_labels = m["spec"]["template"]["metadata"]["labels"]
            selector = m["spec"]["selector"]["matchLabels"]
            assert selector.items() <= pod_labels.items(), m["metadata"]["name"]
            assert set(selector) == SELECTOR_KEYS


def test_selectors_identical_across_variants(render: Renderer) -> None:
    # Variants that keep the chart name; nameOverride legitimately changes the name label.
    seen = {
        variant: workload_selectors(render.variant(variant, "--set", "nameOverride="))
        for variant in VARIANTS
    }
    by_component: dict[str, list[dict[str, str]]] = {}
    for per_variant in seen.values():
        for key, labels in per_variant.items():
            by_component.setdefault(key.rsplit("/", 1)[-1], []).append(labels)
    assert set(by_component) == {"coordinator", "participant"}
    for component, all_labels in by_component.items():
        assert all(labels == all_labels[0] for labels in all_labels), (component, all_labels)


def test_selectors_survive_a_chart_and_app_version_bump(
    helm: Path, render: Renderer, chart_copy: Path
) -> None:
    """Selectors are immutable in a Deployment/StatefulSet: an upgrade must not change them."""
    chart_yaml = chart_copy / "Chart.yaml"
    meta = yaml.safe_load(chart_yaml.read_text())
    meta["version"], meta["appVersion"] = "9.8.7", "9.8.7"
    chart_yaml.write_text(yaml.safe_dump(meta))
    bumped = run_helm(helm, *template_args(chart_copy))
    assert bumped.returncode == 0, bumped.stderr
    assert "9.8.7" in bumped.stdout
    assert selectors(parse(bumped.stdout)) == selectors(render())


def container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_point_at_served_ports_and_paths(render: Renderer, variant: str) -> None:
    expected_path = {
        "livenessProbe": "/healthz",
        "startupProbe": "/healthz",
        "readinessProbe": "/readyz",
    }
    probed = 0
    for m, spec in pod_specs(render.variant(variant)):
        for c in spec["containers"]:
            ports = container_ports(c)
            for probe, path in expected_path.items():
                if probe not in c:
                    continue
                probed += 1
                get = c[probe]["httpGet"]
                assert get["path"] == path, (m["metadata"]["name"], probe)
                port = get["port"]
                assert port in ports or port in ports.values(), (m["metadata"]["name"], probe, port)
    if variant != "probes-off-values.yaml":
        assert probed == 6  # three probes on the coordinator and on the participant


def test_metrics_port_moves_config_container_port_probes_and_service(render: Renderer) -> None:
    manifests = render("--set", "metrics.port=9500")
    config = yaml.safe_load(one(manifests, "ConfigMap", "-pipeline")["data"]["pipeline.yaml"])
    assert config["metrics"] == {"port": 9500}
    for name in ("-coordinator", "-participant"):
        workload = next(
            m
            for m in manifests
            if m["kind"] in ("Deployment", "StatefulSet") and m["metadata"]["name"].endswith(name)
        )
        (c,) = workload["spec"]["template"]["spec"]["containers"]
        assert container_ports(c) == {"http-metrics": 9500}
        assert c["livenessProbe"]["httpGet"]["port"] == "http-metrics"
    service = one(manifests, "Service", "-metrics")
    assert service["spec"]["ports"][0]["targetPort"] == "http-metrics"


@pytest.mark.parametrize("variant", VARIANTS)
def test_services_target_a_named_port_of_selected_pods(render: Renderer, variant: str) -> None:
    manifests = render.variant(variant)
    pods = [
        (m["spec"]["template"]["metadata"]["labels"], m["spec"]["template"]["spec"])
        for m in manifests
        if m["kind"] in ("Deployment", "StatefulSet")
    ]
    for svc in by_kind(manifests, "Service"):
        selected = [
            spec for labels, spec in pods if svc["spec"]["selector"].items() <= labels.items()
        ]
        assert selected, f"Service {svc['metadata']['name']} selects no pods"
        for port in svc["spec"]["ports"]:
            for spec in selected:
                assert port["targetPort"] in container_ports(spec["containers"][0])


@pytest.mark.parametrize(
    ("probe", "component"),
    [
        (p, c)
        for p in ("livenessProbe", "readinessProbe", "startupProbe")
        for c in ("coordinator", "participant")
    ],
)
def test_each_probe_switches_off_alone(render: Renderer, probe: str, component: str) -> None:
    manifests = render("--set", f"{component}.{probe}.enabled=false")
    for m in manifests:
        if m["kind"] in ("Deployment", "StatefulSet"):
            (c,) = m["spec"]["template"]["spec"]["containers"]
            others = {"livenessProbe", "readinessProbe", "startupProbe"} - {probe}
            if c["name"] == component:
                assert probe not in c
                assert others <= set(c)
            else:
                assert {"livenessProbe", "readinessProbe", "startupProbe"} <= set(c)


def kinds_named(manifests: list[Manifest]) -> set[str]:
    return {
        f"{m['kind']}/{m['metadata']['name'].removeprefix('orders-twophase')}" for m in manifests
    }


OPTIONAL = [
    ("participant.autoscaling.enabled", "HorizontalPodAutoscaler/-participant"),
    ("coordinator.podDisruptionBudget.enabled", "PodDisruptionBudget/-coordinator"),
    ("participant.podDisruptionBudget.enabled", "PodDisruptionBudget/-participant"),
    ("metrics.serviceMonitor.enabled", "ServiceMonitor/"),
    ("metrics.service.enabled", "Service/-metrics"),
    ("topicsJob.enabled", "Job/-topics"),
    ("topicsJob.enabled", "ConfigMap/-topics"),
    ("helmTest.enabled", "Pod/-test-status"),
    ("serviceAccount.create", "ServiceAccount/"),
]


@pytest.mark.parametrize(("flag", "obj"), OPTIONAL)
def test_optional_objects_switch_on_and_off(render: Renderer, flag: str, obj: str) -> None:
    on = kinds_named(render("--set", f"{flag}=true"))
    off = kinds_named(render("--set", f"{flag}=false"))
    assert obj in on
    assert obj not in off
    # Nothing else appears or disappears with the switch, except the documented couplings.
    coupled = {"ConfigMap/-topics", "Job/-topics"} if flag == "topicsJob.enabled" else {obj}
    assert on - off == coupled


def test_defaults_are_the_minimal_set(render: Renderer) -> None:
    assert kinds_named(render()) == {
        "ConfigMap/-pipeline",
        "ConfigMap/-topics",
        "Deployment/-coordinator",
        "Job/-topics",
        "Pod/-test-status",
        "Service/-metrics",
        "Service/-participant-headless",
        "ServiceAccount/",
        "StatefulSet/-participant",
    }


def test_coordinator_defaults_to_leader_plus_standby(render: Renderer) -> None:
    deployment = one(render(), "Deployment", "-coordinator")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["coordinator", "run", "/etc/twophase/pipeline.yaml"]
    assert "TWOPHASE_PARTICIPANT_ID" not in {e["name"] for e in c["env"]}


@pytest.mark.parametrize("kind", ["StatefulSet", "Deployment"])
def test_participant_kind_switch(render: Renderer, kind: str) -> None:
    manifests = render(
        "--set", f"participant.kind={kind}", "--set", "participant.autoscaling.enabled=true"
    )
    workload = one(manifests, kind, "-participant")
    other = "Deployment" if kind == "StatefulSet" else "StatefulSet"
    assert not [
        m for m in by_kind(manifests, other) if m["metadata"]["name"].endswith("-participant")
    ]
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["participant", "run", "/etc/twophase/pipeline.yaml"]
    participant_id = [e for e in c["env"] if e["name"] == "TWOPHASE_PARTICIPANT_ID"]
    assert participant_id == [
        {
            "name": "TWOPHASE_PARTICIPANT_ID",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
        }
    ]
    # The HPA owns replicas when enabled; rendering them would reset the HPA on every upgrade.
    assert "replicas" not in workload["spec"]
    hpa = one(manifests, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": kind,
        "name": workload["metadata"]["name"],
    }
    headless = [
        m for m in by_kind(manifests, "Service") if m["metadata"]["name"].endswith("-headless")
    ]
    if kind == "StatefulSet":
        assert workload["spec"]["serviceName"] == headless[0]["metadata"]["name"]
    else:
        assert headless == []


def test_statefulset_persistence(render: Renderer) -> None:
    sts = one(
        render(
            "--set",
            "participant.persistence.enabled=true",
            "--set",
            "participant.persistence.size=5Gi",
        ),
        "StatefulSet",
    )
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert {"name": "data", "mountPath": "/data"} in c["volumeMounts"]
    # Staged files of a prepared transaction must survive a scale-down.
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"]["whenScaled"] == "Retain"


def test_topics_hook_runs_before_install_and_upgrade_with_its_own_config(render: Renderer) -> None:
    manifests = render.variant("full-values.yaml")
    job = one(manifests, "Job", "-topics")
    config = one(manifests, "ConfigMap", "-topics")
    assert hook(job) == hook(config) == "pre-install,pre-upgrade"
    weight = lambda m: int(m["metadata"]["annotations"]["helm.sh/hook-weight"])  # noqa: E731
    assert weight(config) < weight(job), "the hook ConfigMap must exist before the Job starts"
    spec = job["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["args"] == ["topics", "create", "/etc/twophase/pipeline.yaml"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "pipeline-config"]
    assert volume["configMap"]["name"] == config["metadata"]["name"]
    # Same pipeline config as the running pods.
    main = one(manifests, "ConfigMap", "-pipeline")
    assert config["data"] == main["data"]
    # A ServiceAccount the chart creates does not exist yet at pre-install time.
    created = {m["metadata"]["name"] for m in by_kind(manifests, "ServiceAccount")}
    assert spec["serviceAccountName"] not in created


def test_helm_test_pod_runs_status(render: Renderer) -> None:
    pod = one(render(), "Pod", "-test-status")
    assert hook(pod) == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    (c,) = pod["spec"]["containers"]
    assert c["args"] == ["status", "/etc/twophase/pipeline.yaml"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_pod_is_locked_down(render: Renderer, variant: str) -> None:
    for m, spec in pod_specs(render.variant(variant)):
        where = f"{m['kind']}/{m['metadata']['name']}"
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert spec["automountServiceAccountToken"] is False, where
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes["tmp"], where
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["runAsNonRoot"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert "add" not in sc["capabilities"], where
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"], where
            assert ":latest" not in c["image"], where


def test_image_tag_defaults_to_app_version_and_digest_wins(render: Renderer) -> None:
    (c,) = one(render(), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "ghcr.io/twophase/twophase:0.1.0"
    (c,) = one(render.variant("full-values.yaml"), "Deployment")["spec"]["template"]["spec"][
        "containers"
    ]
    assert c["image"].startswith("registry.example.com/data/twophase@sha256:")


def test_config_change_rolls_the_pods(render: Renderer) -> None:
    def checksum(*args: str) -> str:
        deployment = one(render(*args), "Deployment")
        return str(deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"])

    assert checksum() != checksum("--set", "pipeline.commit.interval_ms=500")
    assert checksum() == checksum("--set", "coordinator.replicas=3")
