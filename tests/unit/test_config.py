"""Pipeline configuration: start-up validation names the field and file; secrets stay secret."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ValidationError, field_validator, model_validator

from twophase.config import load_config, parse_config, redact, validation_error
from twophase.errors import ConfigError
from twophase.participants.registry import build_sinks, check_config

BASE = {
    "pipeline": "orders",
    "kafka": {"bootstrap_servers": "127.0.0.1:9092", "config": {"security.protocol": "PLAINTEXT"}},
    "sources": [{"topic": "orders"}],
    "sinks": [{"name": "files", "type": "files", "path": "/tmp/x"}],
}


def _with(**changes: object) -> dict[str, object]:
    return {**BASE, **changes}


def test_a_valid_config_has_derived_names() -> None:
    cfg = parse_config(BASE, env={})
    assert cfg.control_topic == "twophase.control.orders"
    assert cfg.reply_topic == "twophase.control.orders.replies"
    assert cfg.dead_letter_topic == "orders.dlq"
    assert cfg.transactional_id == "twophase.orders.coordinator"  # stable, never random
    assert cfg.group_id == "twophase.orders"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (_with(pipeline="bad name!"), "pipeline"),
        (_with(commit={"interval_ms": "soon"}), "commit.interval_ms"),
        (_with(commit={"vote_timeout_ms": 5}), "commit.vote_timeout_ms"),
        (_with(sources=[]), "sources"),
        (_with(kafka={}), "kafka.bootstrap_servers"),
        (_with(surprise=1), "surprise"),
        (_with(sinks=[{"type": "files"}]), "sinks"),
        (_with(sources=[{"topic_pattern": "cdc\\.(.*"}]), "sources[0].topic_pattern"),
        (_with(sources=[{"topic": "a", "topic_pattern": "b.*"}]), "sources[0]"),
        (_with(sources=[{"format": "json"}]), "sources[0]"),
        # The replies need a topic of their own: any other of the pipeline's would take them.
        (_with(control={"reply_topic": "orders"}), "control.reply_topic"),
        (_with(control={"reply_topic": "twophase.control.orders"}), "control.reply_topic"),
        (_with(control={"reply_topic": "orders.dlq"}), "control.reply_topic"),
        (
            _with(control={"topic": "ctl", "reply_topic": "ctl"}, sources=[{"topic": "o"}]),
            "control.reply_topic",
        ),
        # Control messages read as records, dead letters read again as input: refused.
        (_with(control={"topic": "orders"}), "control.topic"),
        (_with(dead_letter={"topic": "orders"}), "dead_letter.topic"),
        (_with(dead_letter={"topic": "twophase.control.orders"}), "dead_letter.topic"),
        # An empty key (an empty ${ENV:..} or secret file) would turn authentication off.
        (_with(control={"hmac_key": ""}), "control.hmac_key"),
        # Past what librdkafka's consume() and the control messages' fields take.
        (_with(participant={"max_batch_records": 2_000_000}), "participant.max_batch_records"),
        (_with(commit={"vote_timeout_ms": 10**20}), "commit.vote_timeout_ms"),
        # An alarm shorter than two intervals goes off on every healthy cycle.
        (_with(commit={"interval_ms": 300_000}), "commit.stall_alarm_s"),
        # Set by twophase itself: a passthrough value would be overwritten unseen.
        (
            _with(kafka={"bootstrap_servers": "k:1", "config": {"group.id": "g"}}),
            "kafka.config.group.id",
        ),
        (_with(kafka={"bootstrap_servers": ""}), "kafka.bootstrap_servers"),
        # A topic read as two sources would take the first one's options only.
        (_with(sources=[{"topic": "orders"}, {"topic": "orders"}]), "sources[1].topic"),
        (
            _with(sinks=[{"name": "a", "type": "files"}, {"name": "a", "type": "files"}]),
            "sinks[1].name",
        ),
    ],
)
def test_errors_name_the_field(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(raw, source="pipeline.yaml", env={})
    assert err.value.field == field
    assert "pipeline.yaml" in str(err.value)


def test_sink_sections_are_validated_by_their_own_model() -> None:
    cfg = parse_config(
        _with(
            sinks=[{"name": "pg", "type": "postgres", "dsn": "postgresql://x/y", "mode": "upsert"}]
        ),
        env={},
    )
    with pytest.raises(ConfigError) as err:
        build_sinks(cfg.sinks, pipeline="orders", participant="p", source="pipeline.yaml")
    assert err.value.field.startswith("sinks[0].")


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"mode": "upsert", "key": ["id"], "create_table": {"a": "int"}}, r"key column\(s\) id"),
        ({"mode": "update", "create_table": {"a": "int"}}, "without a primary key"),
        ({"columns": {"a": "a"}, "create_table": {"b": "int"}}, "no column a"),
    ],
)
def test_a_table_create_table_would_make_unwritable_fails_at_start_up(
    options: dict[str, object], says: str
) -> None:
    """Each of these used to pass validation and fail at the first record (a CREATE TABLE
    naming a key it lacks, an upsert into a table without a key, a mapping to no column)."""
    sink = {"name": "pg", "type": "postgres", "dsn": "postgresql://x/y", "table": "t", **options}
    cfg = parse_config(_with(sinks=[sink]), env={})
    with pytest.raises(ConfigError, match=says) as err:
        build_sinks(cfg.sinks, pipeline="orders", participant="p", source="pipeline.yaml")
    assert err.value.field == "sinks[0].create_table", err.value.field


def test_unknown_sink_type_lists_the_installed_ones() -> None:
    cfg = parse_config(_with(sinks=[{"name": "x", "type": "nosuch"}]), env={})
    with pytest.raises(ConfigError, match="postgres") as err:
        build_sinks(cfg.sinks, pipeline="orders", participant="p")
    assert err.value.field == "sinks[0].type"


def test_secrets_come_from_env_and_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "hmac"
    secret.write_text("from-a-file\n")
    raw = _with(
        control={"hmac_key": f"${{FILE:{secret}}}"}, kafka={"bootstrap_servers": "${ENV:BOOT}"}
    )
    monkeypatch.delenv("BOOT", raising=False)
    with pytest.raises(ConfigError) as err:
        parse_config(raw, env={})
    assert err.value.field == "kafka.bootstrap_servers" and "BOOT" in str(err.value)
    monkeypatch.setenv("BOOT", "broker:9092")
    cfg = parse_config(raw, env={})
    assert cfg.kafka.bootstrap_servers == "broker:9092"
    assert cfg.hmac_key == b"from-a-file"
    assert "from-a-file" not in repr(cfg)  # SecretStr: never in reprs, so never in logs


def test_missing_secret_file_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(_with(control={"hmac_key": f"${{FILE:{tmp_path}/nope}}"}), env={})
    assert err.value.field == "control.hmac_key"


def test_environment_overrides_any_field() -> None:
    cfg = parse_config(
        BASE, env={"TWOPHASE__COMMIT__INTERVAL_MS": "250", "TWOPHASE__METRICS__PORT": "0"}
    )
    assert cfg.commit.interval_ms == 250
    assert cfg.metrics.port == 0


def test_environment_overrides_keep_text_for_text_fields_and_never_show_a_bad_value() -> None:
    """YAML reads 12345 and 0777 as numbers: a string field then refused the key, a password
    became 511, and an unparsable value ended in a traceback that printed it. Text fields keep
    their text (YAML's quotes and nulls still work), settings passed through keep YAML's
    typing where it spells the number as written (librdkafka's flags, the registry client's
    numbers), and a value that fails elsewhere is named by its variable without its value."""
    cfg = parse_config(
        {**BASE, "schema_registry": {"url": "http://r:1"}},
        env={
            "TWOPHASE__CONTROL__HMAC_KEY": "12345",
            "TWOPHASE__KAFKA__CONFIG__SASL.PASSWORD": "0777",
            "TWOPHASE__KAFKA__CONFIG__ENABLE.IDEMPOTENCE": "yes",
            "TWOPHASE__KAFKA__CONFIG__LINGER.MS": "5",
            "TWOPHASE__SCHEMA_REGISTRY__CONFIG__CACHE.CAPACITY": "500",
            "TWOPHASE__METRICS__HOST": "::",
            "TWOPHASE__PARTICIPANT__MAX_BATCH_RECORDS": "100",
            "TWOPHASE__COMMIT__STALL_ALARM_S": "2.5",
            "TWOPHASE__CONTROL__TOPIC_CONFIG__MIN.INSYNC.REPLICAS": "2",
        },
    )
    assert cfg.hmac_key == b"12345"
    assert cfg.kafka.config == {
        "security.protocol": "PLAINTEXT",
        "sasl.password": "0777",
        "enable.idempotence": True,
        "linger.ms": 5,
    }
    assert cfg.schema_registry is not None and cfg.schema_registry.config["cache.capacity"] == 500
    assert cfg.metrics.host == "::" and cfg.control.topic_config == {"min.insync.replicas": "2"}
    assert cfg.participant.max_batch_records == 100 and cfg.commit.stall_alarm_s == 2.5
    quoted = parse_config(BASE, env={"TWOPHASE__CONTROL__HMAC_KEY": '"abc"'})
    assert quoted.hmac_key == b"abc"
    # Text YAML would change is kept as written: an anchor, a comment, a PEM's lines, a flag
    # in a password.
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----"
    kept = parse_config(
        BASE,
        env={
            "TWOPHASE__CONTROL__HMAC_KEY": "&Kx9",
            "TWOPHASE__KAFKA__CONFIG__SASL.PASSWORD": "a #b",
            "TWOPHASE__KAFKA__CONFIG__SSL.KEY.PASSWORD": "yes",
            "TWOPHASE__KAFKA__CONFIG__SSL.CERTIFICATE.PEM": pem,
        },
    )
    assert kept.hmac_key == b"&Kx9"
    assert kept.kafka.config["sasl.password"] == "a #b"
    assert kept.kafka.config["ssl.key.password"] == "yes"
    assert kept.kafka.config["ssl.certificate.pem"] == pem
    assert parse_config(BASE, env={"TWOPHASE__CONTROL__HMAC_KEY": "Null"}).hmac_key is None
    with pytest.raises(ConfigError) as err:
        parse_config(BASE, env={"TWOPHASE__COMMIT__INTERVAL_MS": "{s3cr3t-x"})
    assert err.value.field == "commit.interval_ms" and "s3cr3t" not in str(err.value)
    assert "TWOPHASE__COMMIT__INTERVAL_MS" in str(err.value)


def test_files_a_uri_or_the_registry_names_are_the_participant_s_to_read_not_validate_s() -> None:
    """Validation reads no certificate: a config checked on a machine without them is fine
    (a misspelt setting is not)."""
    mongo = {
        "name": "m",
        "type": "mongodb",
        "uri": "mongodb://db/?tls=true&tlsCAFile=/nonexistent/ca.pem",
        "database": "d",
        "collection": "c",
    }
    registry = {"url": "http://r:8081", "config": {"ssl.ca.location": "/nonexistent/ca.crt"}}
    raw = _with(
        sinks=[mongo], sources=[{"topic": "orders", "value_format": "avro"}],
        schema_registry=registry,
    )  # fmt: skip
    check_config(parse_config(raw, env={}))
    registry["config"] = {"ssl.ca.locaton": "/nonexistent/ca.crt"}
    with pytest.raises(ConfigError, match=r"ssl\.ca\.locaton") as err:
        check_config(parse_config(raw, env={}))
    assert err.value.field == "schema_registry.config"


def test_a_file_that_is_not_utf8_or_aliases_itself_is_a_named_error(tmp_path: Path) -> None:
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe pipeline: x\n")
    with pytest.raises(ConfigError, match=r"bin\.yaml.*not UTF-8"):
        load_config(binary)
    looped = tmp_path / "loop.yaml"
    looped.write_text("pipeline: orders\nextra: &a [*a]\n")
    with pytest.raises(ConfigError, match="alias refers to itself"):
        load_config(looped)


def test_load_config_reports_yaml_errors_with_the_file(tmp_path: Path) -> None:
    p = tmp_path / "broken.yaml"
    p.write_text("pipeline: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml"):
        load_config(p)
    p.write_text(yaml.safe_dump(BASE))
    assert load_config(p).pipeline == "orders"


def test_redact_masks_secret_looking_settings(caplog: pytest.LogCaptureFixture) -> None:
    settings = {"sasl.password": "hunter2", "bootstrap.servers": "b:9092", "ssl.key.password": "k"}
    shown = redact(settings)
    assert shown["sasl.password"] == "***" and shown["ssl.key.password"] == "***"
    assert shown["bootstrap.servers"] == "b:9092"
    logging.getLogger("t").warning("%s", shown)
    assert "hunter2" not in caplog.text


def test_yaml_syntax_errors_give_the_position_never_the_text(tmp_path: Path) -> None:
    p = tmp_path / "broken.yaml"
    p.write_text('pipeline: p\nsinks:\n  - dsn: "postgresql://u:hunter2-secret@h\n    table: t\n')
    with pytest.raises(ConfigError) as err:
        load_config(p)
    text = str(err.value)
    assert "broken.yaml" in text and "line 3, column 10" in text, text
    assert "hunter2" not in text and "postgresql" not in text, text
    p.write_text("a: b\n\tc: hunter2\n")  # a scanner error: PyYAML names the character only
    with pytest.raises(ConfigError, match=r"line 2, column 1") as err:
        load_config(p)
    assert "hunter2" not in str(err.value)


class _Sink(BaseModel):
    dsn: str
    key: list[str] = []
    table: str = "t"

    @field_validator("dsn")
    @classmethod
    def _dsn(cls, value: str) -> str:
        if "@" not in value:
            raise ValueError(f"{value!r} is not a URI")  # a careless message quotes its input
        return value

    @model_validator(mode="after")
    def _key(self) -> _Sink:
        if self.key and self.table in self.dsn:
            raise ValueError(f"key {self.key} clashes with {self.dsn}")
        return self


def test_validation_errors_name_the_field_and_mask_secret_values() -> None:
    with pytest.raises(ValidationError) as exc:
        _Sink.model_validate({"dsn": "host=h password=hunter2"})
    err = validation_error(exc.value, prefix="sinks[0].", source="pipeline.yaml")
    assert err.field == "sinks[0].dsn" and "pipeline.yaml" in str(err)
    assert "hunter2" not in str(err) and "***" in str(err), err
    # A model-level message sees every field: secrets are masked, upsert key names are not.
    with pytest.raises(ValidationError) as exc:
        _Sink.model_validate({"dsn": "postgresql://u:hunter2@h/t", "key": ["order_id"]})
    err = validation_error(exc.value, prefix="sinks[0].")
    assert err.field == "sinks[0]" and "hunter2" not in str(err), err
    assert "order_id" in str(err), err


def test_topic_patterns_match_whole_names_and_never_the_pipelines_own_topics() -> None:
    cfg = parse_config(
        _with(
            sources=[
                {"topic": "cdc.inventory.audit"},
                {"topic_pattern": r"cdc\.inventory\..*", "format": "debezium"},
                {"topic_pattern": ".*"},
            ],
            dead_letter={"topic": "cdc.inventory.dlq"},
        ),
        env={},
    )
    existing = [
        "cdc.inventory.orders",
        "cdc.inventory.audit",
        "cdc.inventory.dlq",  # the pipeline's own dead letters: never a source
        "twophase.control.orders",
        "__consumer_offsets",
        "xcdc.inventory.orders",  # matches only the catch-all: re.fullmatch, not search
    ]
    assert cfg.resolve_topics(existing) == [
        "cdc.inventory.audit",
        "cdc.inventory.orders",
        "xcdc.inventory.orders",
    ]
    assert cfg.source_for("cdc.inventory.audit") is cfg.sources[0]  # named beats matched
    assert cfg.source_for("cdc.inventory.orders") is cfg.sources[1]  # first pattern wins
    assert cfg.source_for("xcdc.inventory.orders") is cfg.sources[2]
    assert cfg.source_topics == ["cdc.inventory.audit"]
    assert cfg.has_topic_patterns


def test_a_named_topic_no_sink_takes_fails_at_start_up_naming_it() -> None:
    from twophase.participants.registry import check_config

    raw = _with(
        sources=[{"topic": "orders"}, {"topic": "refunds"}],
        sinks=[{"name": "files", "type": "files", "path": "/tmp/x", "topics": ["orders"]}],
    )
    with pytest.raises(ConfigError) as err:
        check_config(parse_config(raw, env={}))
    assert err.value.field == "sources[1].topic" and "no sink takes" in str(err.value)
    bad = _with(sinks=[{"name": "files", "type": "files", "path": "/tmp/x", "topics": ["(a"]}])
    with pytest.raises(ConfigError) as err:
        check_config(parse_config(bad, env={}))
    assert err.value.field.startswith("sinks[0].topics"), err.value.field
