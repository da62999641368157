"""docs/config.md is generated from the config models (cli/configdoc.py) and kept fresh."""

from __future__ import annotations

import re
from typing import Any

from twophase.cli import configdoc
from twophase.config import PipelineConfig
from twophase.participants.registry import available_sinks


def _all_rows() -> list[configdoc.Row]:
    rows = configdoc.model_rows(PipelineConfig)
    for key, model, _ in configdoc.SECTIONS:
        rows += configdoc.model_rows(model, f"{key}.")
    for type_name, model in configdoc.builtin_sink_models().items():
        rows += configdoc.model_rows(model, f"sinks[type={type_name}].")
    return rows


def test_the_page_is_current() -> None:
    page = configdoc.DOC_PATH.read_text() if configdoc.DOC_PATH.exists() else ""
    assert page == configdoc.render(), (
        f"{configdoc.DOC_PATH} is stale (a config model changed): run `{configdoc.REGENERATE}` "
        "(python -m twophase.cli.configdoc --write) and commit the page"
    )


def test_every_option_says_what_it_means() -> None:
    missing = [r.name for r in _all_rows() if not r.meaning]
    assert not missing, (
        f"options without a meaning: {missing}; add a `#:` comment above the field (or "
        f"Field(description=...)), then run `{configdoc.REGENERATE}`"
    )


def test_the_page_names_every_option_once_with_type_and_default() -> None:
    page = configdoc.render()
    for r in _all_rows():
        assert r.type and r.default, r
    for name in ("sources[].partitions", "control.replication_factor", "commit.interval_ms"):
        assert len(re.findall(rf"^\| `{re.escape(name)}` \|", page, re.M)) == 1, name
    for option in ("mode", "key", "columns", "create_table", "partition_by", "socket_timeout_s"):
        assert f"| `{option}` |" in page, option


def _resolve(value: Any) -> Any:
    if isinstance(value, str):
        return re.sub(r"\$\{(ENV|FILE):[^}]+\}", "mongodb://db/?replicaSet=rs", value)
    if isinstance(value, dict):
        return {k: _resolve(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v) for v in value]
    return value


def test_every_builtin_sink_has_a_valid_example() -> None:
    models = configdoc.builtin_sink_models()
    assert set(models) <= set(available_sinks())
    assert set(configdoc.SINK_EXAMPLES) == set(models)
    for type_name, model in models.items():
        model.model_validate(_resolve(configdoc.SINK_EXAMPLES[type_name]))
