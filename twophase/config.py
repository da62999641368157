"""Pipeline configuration: one YAML file, validated at start-up, errors that name the field.

Secrets never sit in the file: a value ``${ENV:NAME}`` is read from the environment and
``${FILE:/path}`` from a file (a mounted Kubernetes secret). Any environment variable
``TWOPHASE__A__B=value`` overrides ``a.b`` in the file (double underscores separate levels).
Every librdkafka setting passes through under ``kafka.config`` (all clients), ``kafka.consumer``
and ``kafka.producer``.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from twophase.errors import ConfigError
from twophase.retry import SINK_RETRY_S

__all__ = [
    "CommitConfig",
    "ControlConfig",
    "KafkaConfig",
    "ParticipantConfig",
    "PipelineConfig",
    "SourceConfig",
    "check_kafka_settings",
    "load_config",
    "load_yaml",
    "parse_config",
    "validation_error",
]

_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$"
_REF = re.compile(r"\$\{(ENV|FILE):([^}]+)\}")
_SECRET_KEYS = ("password", "secret", "key", "token", "uri", "dsn", "sasl.password")
#: Keys that contain a secret-looking word and name no secret: a sink's upsert ``key`` (field
#: names), a source's ``key_format`` and ``key_field``.
_NOT_SECRET_KEYS = frozenset({"key", "key_format", "key_field"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


#: librdkafka settings twophase sets itself (the protocol needs its own values): one in a
#: passthrough section would be overwritten unseen, so it is refused.
_OWN_KAFKA_SETTINGS = {
    "group.id": "the pipeline's group is twophase.<pipeline>",
    "transactional.id": "the coordinator's is twophase.<pipeline>.coordinator",
    "isolation.level": "the control readers need read_committed",
}


class KafkaConfig(_Strict):
    #: ``host:port[,host:port...]`` of the Kafka cluster (librdkafka's ``bootstrap.servers``).
    bootstrap_servers: str = Field(min_length=1)
    #: librdkafka settings for every client (security.protocol, sasl.*, ssl.*, ...).
    config: dict[str, str | int | float | bool] = Field(default_factory=dict)
    #: librdkafka settings for the consumers only (source and control readers), over ``config``.
    consumer: dict[str, str | int | float | bool] = Field(default_factory=dict)
    #: librdkafka settings for the producers only (control, decisions, dead letters), over ``config``.
    producer: dict[str, str | int | float | bool] = Field(default_factory=dict)

    @field_validator("config", "consumer", "producer")
    @classmethod
    def _not_ours(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if key in _OWN_KAFKA_SETTINGS:
                raise ValueError(f"{key}: set by twophase, not here ({_OWN_KAFKA_SETTINGS[key]})")
        return value


#: The longest interval or timeout in milliseconds: ~24.8 days, a signed 32-bit count (what
#: the control messages and the stores' own timeouts carry); past it a value is a typo.
_MAX_MS = 2**31 - 1


class ControlConfig(_Strict):
    #: The control topic; empty: ``twophase.control.<pipeline>``.
    topic: str = ""
    #: HMAC-SHA256 key for control messages; with it, unauthenticated messages are rejected.
    #: Leave it out (or null) to run without authentication; an empty key is refused (an empty
    #: ``${ENV:...}`` or secret file would otherwise turn authentication off unnoticed).
    hmac_key: SecretStr | None = None

    @field_validator("hmac_key")
    @classmethod
    def _key_not_empty(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and not key.get_secret_value():
            raise ValueError("empty; leave it out (or null) to run without authentication")
        return key

    #: Not used: the control topic is always made with one partition (the protocol needs one
    #: total order of control messages).
    partitions: int = 1
    #: Replication factor of the control topic when ``twophase topics create`` makes it.
    replication_factor: int = Field(default=3, ge=1)
    #: Topic settings over those of ``control-topic/topics.yaml`` (e.g. ``min.insync.replicas``;
    #: a number or a flag is taken as Kafka spells it: ``2``, ``true``).
    topic_config: dict[str, str] = Field(default_factory=dict)

    @field_validator("topic_config", mode="before")
    @classmethod
    def _settings_as_text(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        return {
            k: ("true" if v else "false") if isinstance(v, bool)
            else str(v) if isinstance(v, int | float) else v
            for k, v in value.items()
        }  # fmt: skip

    #: The reply topic: participants write their votes and APPLIED there (partition 0), so that
    #: no participant reads its peers' -- with N participants, N^2 deliveries a cycle on the
    #: control topic. ``twophase topics create`` makes it like the control topic (one
    #: partition, its settings); a coordinator that does not find it when it becomes leader has
    #: them sent to the control topic, as before. Empty: ``<control topic>.replies``.
    reply_topic: str = ""


class SchemaRegistryConfig(_Strict):
    """A Confluent-compatible schema registry (Confluent Schema Registry, Apicurio Registry's
    ``/apis/ccompat/v7``, Karapace), for sources whose ``value_format`` or ``key_format`` is
    ``avro``, ``protobuf`` or ``json_schema``. Schemas are fetched by the id each message
    carries and cached; a registry that does not answer is waited for like a store."""

    #: The registry's base URL, e.g. ``http://registry:8081`` or
    #: ``http://apicurio:8080/apis/ccompat/v7``.
    url: str = Field(pattern=r"^https?://")
    #: Basic authentication user (``basic.auth.user.info``'s user part).
    username: str = ""
    #: Basic authentication password (``${ENV:...}``, ``${FILE:...}``).
    password: SecretStr | None = None
    #: Other settings of confluent-kafka's ``SchemaRegistryClient`` (``ssl.ca.location``,
    #: ``ssl.certificate.location``, ``ssl.key.location``, ``timeout``, ...), passed as they are.
    config: dict[str, str | int | float | bool] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _password_needs_user(self) -> SchemaRegistryConfig:
        if self.password is not None and not self.username:
            raise ValueError("password needs username")
        return self


class KafkaFieldsConfig(_Strict):
    """Fields a record gets from its Kafka coordinates (empty: not added). With ``topic``,
    ``partition`` and ``offset`` as a sink's key, every record is its own row exactly once --
    what Kafka Connect calls ``pk.mode: kafka``."""

    #: Field that receives the record's topic.
    topic: str = ""
    #: Field that receives the record's partition.
    partition: str = ""
    #: Field that receives the record's offset.
    offset: str = ""
    #: Field that receives the record's Kafka timestamp (ms since the epoch; -1 when none).
    timestamp: str = ""


class DebeziumConfig(_Strict):
    """How ``format: debezium`` reads change events (``docs/cdc.md``)."""

    #: True: a create, snapshot read or update becomes the row ``after``, a delete deletes the
    #: row of ``before`` (or of the key). False: every event is one record as it is (``before``,
    #: ``after``, ``op``, ``source`` ... as fields): a change log, appended, never deleting.
    unwrap: bool = True
    #: Event fields added to each row, as Debezium's ``ExtractNewRecordState`` ``add.fields``
    #: does: ``op``, ``ts_ms``, or a field of ``source`` (``table``, ``schema``, ``db``,
    #: ``lsn``, ``txId``, ``source.ts_ms``), each named with the prefix and ``.`` as ``_``
    #: (``__op``, ``__table``, ``__source_ts_ms``).
    add_fields: list[str] = Field(default_factory=list)
    #: Prefix of the added fields' names.
    add_fields_prefix: str = "__"


#: Formats read through the schema registry (the Confluent wire format).
REGISTRY_FORMATS = frozenset({"avro", "protobuf", "json_schema"})


class SourceConfig(_Strict):
    #: A source topic the participants consume (one consumer group for the whole pipeline).
    #: Set ``topic`` or ``topic_pattern``.
    topic: str = ""
    #: A Python regular expression a whole topic name must match (``re.fullmatch``): every
    #: matching topic is a source, and topics created while the pipeline runs join it within
    #: ``TOPIC_REFRESH_S`` (10 s). Internal topics (``__*``) and the pipeline's own control and
    #: dead-letter topics never match. A topic named by another source's ``topic`` is that
    #: source's; one matching several patterns belongs to the first.
    topic_pattern: str = ""
    #: How record values are decoded. ``json``: one JSON object per record (a Kafka Connect
    #: ``{schema, payload}`` envelope is not unwrapped: its fields are the record's).
    #: ``debezium``: Debezium change events as JSON, with or without the Kafka Connect
    #: envelope -- creates, reads and updates become rows, deletes become deletes
    #: (``docs/cdc.md``). What does not decode goes to the dead letters with the reason.
    format: Literal["json", "debezium"] = "json"
    #: How a value's bytes decode, before ``format`` says what they mean. ``json``: JSON text
    #: (with ``format: debezium``, a Kafka Connect envelope is recognised and unwrapped).
    #: ``connect_json``: Kafka Connect's JSON converter with ``schemas.enable``: every value is a
    #: ``{schema, payload}`` envelope, unwrapped, its schema kept for the sinks
    #: (``auto_create``, ``auto_evolve``). ``avro``, ``protobuf``, ``json_schema``: the Confluent
    #: wire format (a magic byte and the schema's id in the ``schema_registry``), decoded with
    #: the registered schema, which the sinks get too (``docs/schemas.md``).
    value_format: Literal["json", "connect_json", "avro", "protobuf", "json_schema"] = "json"
    #: Options of ``format: debezium``.
    debezium: DebeziumConfig | None = None
    #: How record keys are read. ``none``: ignored. ``json``: a JSON object (a Kafka Connect
    #: ``{schema, payload}`` envelope unwrapped) whose fields are added to the record, over the
    #: value's -- a sink keyed on them takes the key from the record key (Kafka Connect's
    #: ``pk.mode: record_key``); a record whose key does not decode is dead-lettered.
    #: ``string``: the key's UTF-8 text, as the field ``key_field``. ``avro``, ``protobuf``,
    #: ``json_schema``: the Confluent wire format, like ``value_format``; a record key gives its
    #: fields, or the field ``key_field`` when it is a scalar. A key with a schema names the
    #: target's primary key for ``auto_create``.
    key_format: Literal["none", "json", "string", "avro", "protobuf", "json_schema"] = "none"
    #: With ``key_format`` other than ``none``, the field a key that is a scalar (``42``,
    #: ``"a-1"``) becomes; empty: such a key is dead-lettered. Required with ``string``.
    key_field: str = ""
    #: Fields from the record's Kafka coordinates (``pk.mode: kafka``).
    kafka_fields: KafkaFieldsConfig | None = None
    #: What a tombstone (a record with a null value) means. ``dead_letter``: it goes to the
    #: dead-letter topic. ``delete``: it deletes the row or document of its key (needs
    #: ``key_format: json``). ``skip``: consumed and ignored. Default: ``skip`` for
    #: ``debezium`` (Debezium follows every delete event with a tombstone for log compaction;
    #: the delete event already deleted the row), ``dead_letter`` otherwise.
    tombstones: Literal["dead_letter", "delete", "skip"] | None = None
    #: Partitions when ``twophase topics create`` makes the topic (an existing one is kept).
    partitions: int = Field(default=4, ge=1)
    #: Replication factor when ``twophase topics create`` makes the topic.
    replication_factor: int = Field(default=3, ge=1)

    @field_validator("topic_pattern")
    @classmethod
    def _pattern_compiles(cls, value: str) -> str:
        if value:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        return value

    @model_validator(mode="after")
    def _topic_or_pattern(self) -> SourceConfig:
        if bool(self.topic) == bool(self.topic_pattern):
            raise ValueError("set exactly one of topic and topic_pattern")
        if self.key_format == "string" and not self.key_field:
            raise ValueError("key_field is required with key_format: string (the key's field)")
        return self

    @property
    def name(self) -> str:
        """How logs and errors name the source: its topic, or its pattern."""
        return self.topic or f"/{self.topic_pattern}/"

    @field_validator("debezium")
    @classmethod
    def _debezium_options_need_debezium(
        cls, value: DebeziumConfig | None, info: ValidationInfo
    ) -> DebeziumConfig | None:
        if value is not None and info.data.get("format") != "debezium":
            raise ValueError("used only with format: debezium")
        return value

    @field_validator("key_field")
    @classmethod
    def _key_field_needs_keys(cls, value: str, info: ValidationInfo) -> str:
        key_format = info.data.get("key_format")
        if value and key_format == "none":
            raise ValueError("used only with a key_format")
        return value

    @property
    def registry_formats(self) -> bool:
        """True when a key or value of this source needs the schema registry."""
        return bool(REGISTRY_FORMATS & {self.value_format, self.key_format})

    @field_validator("tombstones")
    @classmethod
    def _tombstone_deletes_need_keys(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value == "delete" and info.data.get("key_format") in (None, "none"):
            raise ValueError(
                "delete needs a key_format (a tombstone names its row only by its key)"
            )
        return value


class DeadLetterConfig(_Strict):
    #: The dead-letter topic (records no sink can take, with the reason); empty: ``<pipeline>.dlq``.
    topic: str = ""
    #: Partitions when ``twophase topics create`` makes the topic.
    partitions: int = Field(default=1, ge=1)
    #: Replication factor when ``twophase topics create`` makes the topic.
    replication_factor: int = Field(default=3, ge=1)


class CommitConfig(_Strict):
    #: How often the leading coordinator starts a commit cycle (PREPARE): the batching latency.
    interval_ms: int = Field(default=1000, ge=50, le=_MAX_MS)
    #: A cycle whose votes are not all in after this long is aborted (its records are retried).
    vote_timeout_ms: int = Field(default=10_000, ge=100, le=_MAX_MS)
    #: Start the next cycle before ``interval_ms`` once the input has gone quiet: each
    #: participant that has read everything its partitions hold and has got no new record for
    #: this long tells the coordinator (a DRAINED control message), and when those cover every
    #: source partition and hold at least ``early_min_records`` records the cycle starts at once.
    #: The end of a burst or a backfill is then committed without waiting for the tick; a steady
    #: stream, which never goes quiet this long, keeps the interval. 0: never early.
    early_idle_ms: int = Field(default=100, ge=0, le=_MAX_MS)
    #: The fewest records (all participants' open parts together) a cycle started early by
    #: ``early_idle_ms`` commits: a sparse stream, a few records now and then, keeps the interval
    #: instead of committing each one on its own.
    early_min_records: int = Field(default=10_000, ge=1)
    #: Consecutive failed cycles before the alarm (``twophase_alarm`` = 1, an ERROR line).
    max_failed_cycles: int = Field(default=5, ge=1)
    #: Decisions between two CHECKPOINT messages: bounds the tail of the control log a
    #: restarting process reads.
    checkpoint_every: int = Field(default=20, ge=1)
    #: A source partition whose records have waited this long while no commit moved its
    #: position raises the stall alarm (``twophase_stalled_partitions``), even if every cycle
    #: commits: a participant that votes but no longer reads.
    stall_alarm_s: float = Field(default=120.0, gt=0)

    @model_validator(mode="after")
    def _stall_alarm_past_a_cycle(self) -> CommitConfig:
        # A healthy pipeline holds a record for up to an interval and the cycle that commits
        # it: an alarm that short would go off, and clear, on every cycle.
        least_s = 2 * self.interval_ms / 1000
        if self.stall_alarm_s < least_s:
            raise ValueError(
                f"stall_alarm_s: {self.stall_alarm_s:g} s is shorter than two intervals "
                f"({least_s:g} s): a healthy pipeline holds records about an interval"
            )
        return self


class ParticipantConfig(_Strict):
    #: This participant's stable id; empty: ``$TWOPHASE_PARTICIPANT_ID``, else the host name.
    id: str = ""
    #: ``exactly_once`` (default): parts prepared on the coordinator's PREPARE, committed on its
    #: decision. ``at_least_once``: no coordinator and no control topic -- each batch is written,
    #: committed in every sink on its own, then its offsets are committed; a crash between the two
    #: replays the batch (duplicates unless the sinks upsert). For comparison and for sinks that
    #: dedupe by key; it keeps none of the all-or-nothing guarantees.
    mode: Literal["exactly_once", "at_least_once"] = "exactly_once"
    #: Most records taken from Kafka and written to the sinks in one batch (librdkafka's
    #: ``consume()`` takes at most 1,000,000).
    max_batch_records: int = Field(default=5000, ge=1, le=1_000_000)
    #: A record value larger than this goes to the dead-letter topic (``oversize``).
    max_record_bytes: int = Field(default=1_048_576, ge=1)
    #: How often a participant looks for in-doubt parts of dead participants and forgets old
    #: markers (``keep_decided_txns``).
    sweep_interval_ms: int = Field(default=15_000, ge=100, le=_MAX_MS)
    #: The sinks keep the markers of this many decided transactions below the last decided one
    #: (``twophase txn show`` reads them); each sweep forgets older ones, never a commit still
    #: pending nor the newest committed one. 0 keeps only what recovery and status need.
    keep_decided_txns: int = Field(default=1000, ge=0)
    #: How long a sink call whose failure the participant survives (a prepare: it votes abort;
    #: a write: the part is re-read; a sweep: the next one tries again) is retried before it is
    #: given up. Calls the process cannot go on without (set-up, start-up recovery, applying a
    #: decision) are not bounded by it: they wait for the store until it answers or the process
    #: is stopped.
    sink_retry_s: float = Field(default=SINK_RETRY_S, gt=0)


class MetricsConfig(_Strict):
    #: Address the HTTP server (``/metrics``, ``/healthz``, ``/readyz``) listens on.
    host: str = "0.0.0.0"
    #: Its port; 0 picks a free one (tests).
    port: int = Field(default=9400, ge=0, le=65535)


class PipelineConfig(_Strict):
    #: The pipeline's name: part of its topic, group and transactional ids, and of every marker.
    pipeline: str = Field(pattern=_NAME)
    #: Kafka connection (section ``kafka``).
    kafka: KafkaConfig
    #: The control topic (section ``control``).
    control: ControlConfig = ControlConfig()
    #: The source topics (section ``sources[]``).
    sources: list[SourceConfig] = Field(min_length=1)
    #: The dead-letter topic (section ``dead_letter``).
    dead_letter: DeadLetterConfig = DeadLetterConfig()
    #: The commit cycle (section ``commit``).
    commit: CommitConfig = CommitConfig()
    #: The participants (section ``participant``).
    participant: ParticipantConfig = ParticipantConfig()
    #: Metrics and health endpoints (section ``metrics``).
    metrics: MetricsConfig = MetricsConfig()
    #: The schema registry of sources in a registry format (section ``schema_registry``).
    schema_registry: SchemaRegistryConfig | None = None
    #: Each entry is validated by its sink's own model (see twophase.participants.registry).
    sinks: list[dict[str, Any]] = Field(min_length=1)
    source_file: str = ""

    @field_validator("sinks")
    @classmethod
    def _sink_names(cls, sinks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        names = [s.get("name") for s in sinks]
        for i, name in enumerate(names):
            if not isinstance(name, str) or not re.match(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$", name):
                raise ValueError(f"sinks[{i}].name must be 1-32 of [A-Za-z0-9_-], got {name!r}")
            if "type" not in sinks[i]:
                raise ValueError(f"sinks[{i}].type is required")
            if name in names[:i]:
                raise ValueError(f"sinks[{i}].name: {name!r} is also sinks[{names.index(name)}]'s")
        return sinks

    @field_validator("sources")
    @classmethod
    def _one_source_per_topic(cls, sources: list[SourceConfig]) -> list[SourceConfig]:
        """A topic read as two sources would be read by the first only (its options; the
        second's ignored): refused."""
        seen: dict[str, int] = {}
        for i, source in enumerate(sources):
            if source.topic in seen:
                raise ValueError(
                    f"sources[{i}].topic: {source.topic} is also sources[{seen[source.topic]}]'s"
                )
            if source.topic:  # a pattern's source has none
                seen[source.topic] = i
        return sources

    @model_validator(mode="after")
    def _registry_for_registry_formats(self) -> PipelineConfig:
        if self.schema_registry is None:
            for i, source in enumerate(self.sources):
                if source.registry_formats:
                    raise ValueError(
                        f"sources[{i}] ({source.name}) reads {source.value_format} values or "
                        f"{source.key_format} keys: set schema_registry.url"
                    )
        return self

    @model_validator(mode="after")
    def _topics_of_their_own(self) -> PipelineConfig:
        """The control, dead-letter and reply topics are the pipeline's own: one that is a
        source topic would feed control messages or replies to the sinks, or dead letters back
        into the input; two that are one topic would mix what each reader expects."""
        taken = {t: "a source topic" for t in self.source_topics}
        for field, topic, what in (
            ("control.topic", self.control_topic, "the control topic"),
            ("dead_letter.topic", self.dead_letter_topic, "the dead-letter topic"),
            ("control.reply_topic", self.reply_topic, "the reply topic"),
        ):
            if topic in taken:
                raise ValueError(f"{field}: {topic} is {taken[topic]}; it needs a topic of its own")
            taken[topic] = what
        return self

    @property
    def control_topic(self) -> str:
        return self.control.topic or f"twophase.control.{self.pipeline}"

    @property
    def reply_topic(self) -> str:
        return self.control.reply_topic or f"{self.control_topic}.replies"

    @property
    def dead_letter_topic(self) -> str:
        return self.dead_letter.topic or f"{self.pipeline}.dlq"

    @property
    def group_id(self) -> str:
        """The participants' consumer group over the source topics."""
        return f"twophase.{self.pipeline}"

    @property
    def coordinator_group_id(self) -> str:
        """The coordinators' group on the control topic: its owner is the leader."""
        return f"twophase.{self.pipeline}.coordinator"

    @property
    def transactional_id(self) -> str:
        """Stable per pipeline, never random: Kafka's epoch fencing depends on it."""
        return f"twophase.{self.pipeline}.coordinator"

    @property
    def participant_id(self) -> str:
        raw = (
            self.participant.id or os.environ.get("TWOPHASE_PARTICIPANT_ID") or socket.gethostname()
        )
        return re.sub(r"[^A-Za-z0-9_.-]", "-", raw)[:64]

    @property
    def hmac_key(self) -> bytes | None:
        key = self.control.hmac_key
        return key.get_secret_value().encode() if key else None

    @property
    def source_topics(self) -> list[str]:
        """The topics the sources name (``topic``); a ``topic_pattern``'s are found in Kafka's
        metadata (:meth:`resolve_topics`)."""
        return [s.topic for s in self.sources if s.topic]

    @property
    def has_topic_patterns(self) -> bool:
        return any(s.topic_pattern for s in self.sources)

    def source_for(self, topic: str) -> SourceConfig | None:
        """The source ``topic`` belongs to: the one naming it, else the first pattern it
        matches (never an internal topic or the pipeline's own control, reply or dead-letter
        topic)."""
        for source in self.sources:
            if source.topic == topic:
                return source
        if topic.startswith("__") or topic in (
            self.control_topic,
            self.reply_topic,
            self.dead_letter_topic,
        ):
            return None
        for source in self.sources:
            if source.topic_pattern and re.fullmatch(source.topic_pattern, topic):
                return source
        return None

    def resolve_topics(self, existing: Iterable[str]) -> list[str]:
        """The source topics among ``existing`` (a broker's topic names), sorted: those the
        sources name and those their patterns match."""
        return sorted({t for t in existing if self.source_for(t) is not None})


def _resolve(value: Any, path: str, source: str) -> Any:
    if isinstance(value, dict):
        return {k: _resolve(v, f"{path}.{k}" if path else str(k), source) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, f"{path}[{i}]", source) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        kind, ref = m.group(1), m.group(2).strip()
        if kind == "ENV":
            if ref not in os.environ:
                raise ConfigError(path, f"environment variable {ref} is not set", source=source)
            return os.environ[ref]
        try:
            return Path(ref).read_text().strip()
        except OSError as exc:
            raise ConfigError(
                path, f"cannot read secret file {ref}: {exc.strerror}", source=source
            ) from None

    return _REF.sub(sub, value)


def _overrides(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in env.items():
        if not name.startswith("TWOPHASE__"):
            continue
        keys = [k.lower() for k in name[len("TWOPHASE__") :].split("__") if k]
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        if keys:
            node[keys[-1]] = _override_value(keys, value, name)
    return out


def _field_kind(keys: list[str]) -> str:
    """What the config field at ``keys`` holds, by the models: ``text`` (a string or a
    secret), ``entry`` (an entry of a passthrough mapping: librdkafka's or the registry
    client's settings), or ``other``."""
    model: Any = PipelineConfig
    for depth, key in enumerate(keys):
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return "other"
        field = model.model_fields.get(key)
        if field is None:
            return "other"
        kinds = get_args(field.annotation) if get_origin(field.annotation) is not dict else ()
        kinds = kinds or (field.annotation,)
        if mappings := [k for k in kinds if get_origin(k) is dict]:
            if depth != len(keys) - 2:
                return "other"
            values = get_args(get_args(mappings[0])[1]) or (get_args(mappings[0])[1],)
            return "text" if all(v in (str, SecretStr) for v in values) else "entry"
        models = [k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)]
        if models:
            model = models[0]
            continue
        return "text" if any(k in (str, SecretStr) for k in kinds) else "other"
    return "other"


#: YAML's spellings of null.
_NULLS = frozenset({"null", "Null", "NULL", "~"})


def _override_value(keys: list[str], value: str, name: str) -> Any:
    """An environment override's value. A text field (and a secret-looking passthrough
    setting) keeps the text as written -- an HMAC key ``12345`` or ``&Kx9``, a password
    ``0777`` or ``a #b``, a PEM's lines -- unless it is quoted (``"abc"``: the quotes go) or a
    YAML null (it clears the value). Anything else is read as YAML (``500``, ``true``,
    ``[a, b]``, ``{k: v}``), as a value in the file would be; a passthrough setting keeps a
    number spelled otherwise than YAML prints it (``0777``) and any text YAML would change. A
    value that does not parse is named by its variable, never shown (it may be a secret)."""
    kind = _field_kind(keys)
    if not value:
        return value
    stripped = value.strip()
    if kind == "text" or (kind == "entry" and _is_secret(keys[-1])):
        if stripped in _NULLS:
            return None
        if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
            with contextlib.suppress(yaml.YAMLError):
                if isinstance(unquoted := yaml.safe_load(stripped), str):
                    return unquoted
        return value
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        if kind == "entry":
            return value
        raise ConfigError(".".join(keys), f"{name} is not a YAML value", source="(env)") from None
    if kind != "entry" or parsed is None or isinstance(parsed, bool):
        return parsed
    if isinstance(parsed, int | float):
        return parsed if str(parsed) == stripped else value
    return parsed if parsed == value else value


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_config(
    raw: Any, *, source: str = "<config>", env: Mapping[str, str] | None = None
) -> PipelineConfig:
    if not isinstance(raw, dict):
        raise ConfigError("(root)", "expected a mapping", source=source)
    merged = _merge(raw, _overrides(os.environ if env is None else env))
    try:
        resolved = _resolve(merged, "", source)
    except RecursionError:
        # A YAML alias inside itself (``a: &a [*a]``): a value with no end.
        raise ConfigError("(root)", "a YAML alias refers to itself", source=source) from None
    try:
        return PipelineConfig.model_validate({**resolved, "source_file": source})
    except ValidationError as exc:
        raise validation_error(exc, source=source) from None


def _is_secret(key: object) -> bool:
    return isinstance(key, str) and any(s in key.lower() for s in _SECRET_KEYS)


def _secret_strings(value: Any, secret: bool) -> list[str]:
    """Every string held under a secret-looking key (or anywhere in ``value`` if it is one)."""
    if isinstance(value, str):
        return [value] if secret and value else []
    if isinstance(value, dict):
        return [
            s
            for k, v in value.items()
            for s in _secret_strings(v, secret or (_is_secret(k) and k not in _NOT_SECRET_KEYS))
        ]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _secret_strings(v, secret)]
    return [str(value)] if secret and value is not None else []


#: "Value error, control.reply_topic: ..." -- how a model validator's error names its field.
#: A check across fields says which field it is about first: ``control.reply_topic: ...``,
#: ``sinks[1].name: ...``, or within a section ``stall_alarm_s: ...``.
_NAMED_FIELD = re.compile(
    r"^Value error, (?P<field>[a-z_][a-z0-9_]*(?:\[\d+\])?(?:\.[a-z_][a-z0-9_]*(?:\[\d+\])?)*): "
    r"(?P<rest>.*)$",
    re.S,
)


def validation_error(exc: ValidationError, *, prefix: str = "", source: str = "") -> ConfigError:
    """The first problem of a pydantic error as a :class:`ConfigError` that names the field.

    Never the value: pydantic's ``str(exc)`` shows ``input_value``, and a custom validator's
    message may quote it. Any value held under a secret-looking key (password, dsn, uri, ...)
    that the message still quotes is masked.
    """
    err = exc.errors()[0]
    loc = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in err["loc"])
    field = (prefix + loc).replace(".[", "[").strip(".")
    message = str(err["msg"])
    if named := _NAMED_FIELD.match(message):
        # A check across fields (a model validator) names the field it is about first: from
        # the root, or (a section's own check) within the section.
        inner = named["field"]
        whole = inner if not loc or inner.startswith(loc.split(".")[0]) else f"{loc}.{inner}"
        field, message = (prefix + whole).replace(".[", "["), named["rest"]
    secret_here = any(_is_secret(p) and p != "key" for p in err["loc"])
    # Longest first, so a secret that contains another is masked whole.
    for value in sorted(set(_secret_strings(err.get("input"), secret_here)), key=len, reverse=True):
        message = message.replace(value, "***")
    return ConfigError(field or "(root)", message, source=source)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where, never the text around it: PyYAML's own message quotes the
    offending line, and that line may hold a secret (a DSN with its password)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        # context/problem are PyYAML's own words (at most a character or a token name from the
        # file); the marks' snippets are the file's text, so only their positions are used.
        parts = [
            f"{text} (line {mark.line + 1}, column {mark.column + 1})" if mark else text
            for text, mark in ((exc.context, exc.context_mark), (exc.problem, exc.problem_mark))
            if text
        ]
        return ": ".join(parts) or type(exc).__name__
    if isinstance(exc, yaml.reader.ReaderError):
        return f"unreadable character at position {exc.position}"
    return type(exc).__name__


def load_yaml(path: str | Path) -> Any:
    """A config file's YAML, or a :class:`ConfigError` that names the file and the position
    of the problem (never the file's text)."""
    p = Path(path)
    try:
        return yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError("(file)", f"cannot read: {exc.strerror}", source=str(p)) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            "(file)", f"not UTF-8 text (byte {exc.start} cannot be read)", source=str(p)
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(
            "(file)", f"not valid YAML: {_yaml_problem(exc)}", source=str(p)
        ) from None


def load_config(path: str | Path) -> PipelineConfig:
    return parse_config(load_yaml(path), source=str(path))


def check_kafka_settings(cfg: PipelineConfig) -> None:
    """librdkafka checks its settings when a client is made, not before: make a producer and a
    consumer with every passthrough setting, and no bootstrap servers so they connect to
    nothing. An unknown property or a bad value is a :class:`ConfigError` naming the section,
    never a KafkaException traceback from the first client a process makes."""
    from confluent_kafka import Consumer, KafkaError, KafkaException, Producer

    from twophase.kafka import client_settings

    for section, role, kind in (
        ("kafka.producer", "producer", Producer),
        ("kafka.consumer", "check-consumer", Consumer),
    ):
        settings = {
            key: value
            for key, value in client_settings(cfg, role).items()
            if not _names_a_file(key)
        }
        settings["bootstrap.servers"] = ""
        if kind is Consumer:
            settings["group.id"] = cfg.group_id
        try:
            client = kind(settings)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            message = str(err.str()) if isinstance(err, KafkaError) else str(exc)
            own = cfg.kafka.producer if kind is Producer else cfg.kafka.consumer
            field = next(
                (
                    f"{name}.{key}"
                    for name, values in ((section, own), ("kafka.config", cfg.kafka.config))
                    for key in values
                    if f'"{key}"' in message
                ),
                "kafka.config",
            )
            secrets = [*_secret_strings(cfg.kafka.config, False), *_secret_strings(own, False)]
            for value in sorted(set(secrets), key=len, reverse=True):
                message = message.replace(value, "***")
            raise ConfigError(field, message, source=cfg.source_file) from None
        if isinstance(client, Consumer):
            client.close()


def _names_a_file(key: str) -> bool:
    """librdkafka reads the file a ``*.location`` or keytab setting names when a client is made:
    those files are the deployment's (a mounted CA in a pod), not the validating machine's, so
    the offline check leaves them out; the process itself reports a missing one at start-up."""
    return key.endswith(".location") or key == "sasl.kerberos.keytab"


def redact(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A copy safe to log: values of secret-looking keys are masked."""
    return {k: "***" if _is_secret(k) else v for k, v in settings.items()}
