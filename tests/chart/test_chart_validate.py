"""helm lint, helm template and Kubernetes schema validation of every rendered object.

Built-in kinds are checked by kubernetes-validate in strict mode (unknown fields are errors)
against two Kubernetes versions: the oldest the chart declares (Chart.yaml kubeVersion) and the
one the pinned helm renders for. ServiceMonitor is a CRD that kubernetes-validate does not know;
it is checked against the openAPIV3Schema of the real CRD, vendored from prometheus-operator
(tests/chart/crds/), made strict the same way.
"""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from chartkit import CHART, VARIANTS, Manifest, Renderer, one, run_helm, values_args

# Oldest supported (Chart.yaml kubeVersion >=1.25) and the version helm v3.21 renders for.
K8S_VERSIONS = ["1.25.0", "1.36.0"]
SERVICEMONITOR_CRD = Path(__file__).parent / "crds" / "monitoring.coreos.com_servicemonitors.yaml"


def test_chart_declares_the_oldest_validated_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">={K8S_VERSIONS[0]}-0"


@pytest.mark.parametrize("variant", VARIANTS)
def test_helm_lint_strict(helm: Path, variant: str) -> None:
    result = run_helm(helm, "lint", "--strict", CHART, *values_args(variant))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("variant", VARIANTS)
def test_helm_template_renders(render: Renderer, variant: str) -> None:
    kinds = {m["kind"] for m in render.variant(variant)}
    assert {"ConfigMap", "Deployment"} <= kinds
    assert kinds & {"StatefulSet", "Deployment"}


def _strict(schema: Any) -> Any:
    """Like kubernetes-validate's strict schemas: objects with declared properties reject others,
    unless the CRD says it keeps unknown fields."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@cache
def servicemonitor_validator() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load(SERVICEMONITOR_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(version["schema"]["openAPIV3Schema"])
    # The CRD leaves metadata to the API server; check ours is an ordinary ObjectMeta shape.
    schema["properties"]["metadata"] = {
        "type": "object",
        "required": ["name", "namespace"],
        "properties": {
            "name": {"type": "string"},
            "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        },
        "additionalProperties": False,
    }
    return jsonschema.Draft7Validator(schema)


def validate(manifest: Manifest, k8s_version: str) -> None:
    if manifest["apiVersion"] == "monitoring.coreos.com/v1":
        assert manifest["kind"] == "ServiceMonitor"
        errors = sorted(servicemonitor_validator().iter_errors(manifest), key=str)
        assert not errors, "\n".join(e.message for e in errors)
    else:
        kubernetes_validate.validate(manifest, k8s_version, strict=True)


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_manifest_is_valid_kubernetes(
    render: Renderer, variant: str, k8s_version: str
) -> None:
    for manifest in render.variant(variant):
        try:
            validate(manifest, k8s_version)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(
                f"{manifest['kind']}/{manifest['metadata']['name']}: {e.message} at {e.path}"
            )


def test_strict_validation_catches_an_unknown_field(render: Renderer) -> None:
    """Guards the test above: it must fail on a typo, for built-in kinds and the CRD alike."""
    manifests = render.variant("full-values.yaml")
    deployment = copy.deepcopy(one(manifests, "Deployment", "-coordinator"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)

    monitor = copy.deepcopy(one(manifests, "ServiceMonitor"))
    validate(monitor, K8S_VERSIONS[-1])
    monitor["spec"]["endpoints"][0]["scrapeTimout"] = "5s"
    with pytest.raises(AssertionError, match="scrapeTimout"):
        validate(monitor, K8S_VERSIONS[-1])
