"""The MongoDB sink's configuration: the ``sinks[]`` entry of ``type: mongodb``."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator

from twophase.participants.sdk import SinkConfig, check_template, check_topic_replace, is_template

__all__ = ["MongoSinkConfig"]

_DB_NAME_FORBIDDEN = re.compile(r'[/\\. "$\x00]')


#: The longest of the timeouts and leases, in seconds (~24.8 days: the driver's milliseconds
#: are a signed 32-bit count); their shortest is a millisecond, which the driver counts in.
_MAX_S = (2**31 - 1) / 1000


class MongoSinkConfig(SinkConfig):
    """``sinks[]`` entry with ``type: mongodb``."""

    type: Literal["mongodb"]
    #: ``mongodb://`` or ``mongodb+srv://`` URI of a replica set or mongos. It may hold a password,
    #: so it is a secret: never logged, never shown in a config dump. Whatever the URI says of
    #: ``readPreference``, ``w`` or ``readConcernLevel``, the sink reads from the primary, its
    #: writes are acknowledged by a majority (journaled), and its transactions set their own
    #: read concerns (majority; snapshot at commit).
    uri: SecretStr
    #: Database of the target collection (1-63 bytes, no ``/\. "$``).
    database: str
    #: The target collection. A template routes each record to a collection of its own:
    #: ``${topic}`` is the record's topic (after ``topic_replace``), ``${value.FIELD}`` a field
    #: of the record, ``${source.FIELD}`` a field of Debezium's ``source`` block, e.g.
    #: ``${source.table}`` (``docs/cdc.md``); each collection is created on its first record.
    collection: str
    #: With a ``collection`` template naming ``${topic}``: ``[pattern, replacement]``, applied
    #: to the topic with ``re.sub`` first (Kafka Connect's RegexRouter).
    topic_replace: tuple[str, str] | None = None
    #: ``insert``: one document per record, ``_id`` = record id. ``upsert``: one document per key,
    #: inserted when absent. ``update``: one document per key, a record whose key has no
    #: document changes nothing (update-only). Deletes apply in ``upsert`` and ``update``.
    mode: Literal["insert", "upsert", "update"] = "insert"
    #: ``upsert``/``update``: False, a record replaces its key's document; True, it sets the
    #: fields it carries (``$set``) and leaves the document's other fields as they are.
    partial: bool = False
    #: Top-level value fields that form the document key (``upsert`` and ``update`` only).
    #: Empty in ``upsert``/``update``: each record's schema names its key (a record key read
    #: with a schema, ``sources[].key_format``; Kafka Connect's ``pk.mode: record_key``), and a
    #: record without one is refused (dead-lettered) with the reason.
    key: list[str] = Field(default_factory=list, validate_default=True)
    #: Where parts wait for their decision; default ``<collection>__twophase_staging``
    #: (``twophase_staging_<sink name>`` with a ``collection`` template).
    staging_collection: str | None = None
    #: Per-part markers and committed positions; may be shared by many sinks and pipelines.
    marker_collection: str = "twophase_parts"
    #: Upsert mode: field holding ``{pipeline, txn}`` so an older part never overwrites a newer
    #: one, whatever order decisions are applied in. ``null`` disables the guard and the field.
    version_field: str | None = "_twophase"
    #: Documents per staged chunk, and so per commit transaction: a part's records are staged
    #: packed into chunk documents of this many, and a commit transaction applies whole chunks
    #: (fixed when the part is staged: a part in doubt is committed in the chunks it was
    #: staged in). MongoDB aborts transactions that run longer than
    #: ``transactionLifetimeLimitSeconds`` (60 s by default); 1000 writes finish well inside
    #: that even on slow servers, and bigger chunks gain little once per-transaction overhead
    #: is amortized.
    commit_chunk_size: int = Field(1000, ge=1, le=100_000)
    #: Bytes of staged documents per chunk and commit transaction (a chunk document holds at
    #: most 12 MiB whatever this says, under MongoDB's 16 MiB document limit): keeps one
    #: transaction's oplog entries and cache pressure modest (MongoDB's per-transaction limits
    #: are in this range).
    commit_chunk_bytes: int = Field(8 * 1024 * 1024, ge=1)
    #: TCP connect; a reachable server answers in milliseconds, so 10 s only covers slow networks.
    connect_timeout_s: float = Field(10.0, ge=0.001, le=_MAX_S)
    #: How long to wait for a writable primary -- longer than a typical election (~10 s).
    server_selection_timeout_s: float = Field(15.0, ge=0.001, le=_MAX_S)
    #: One round trip; must exceed the slowest single operation (a chunk's bulk write).
    socket_timeout_s: float = Field(120.0, ge=0.001, le=_MAX_S)
    #: Waiting for majority acknowledgement; after it the write is retried, not lost.
    write_concern_timeout_s: float = Field(60.0, ge=0.001, le=_MAX_S)
    #: ``maxCommitTimeMS`` of each commit transaction.
    max_commit_time_s: float = Field(60.0, ge=0.001, le=_MAX_S)
    #: How long a committer's claim on a part lasts; it renews the claim before every chunk. As
    #: long as MongoDB's default ``transactionLifetimeLimitSeconds`` (60 s): any chunk that can
    #: still succeed finishes inside it, so a live committer is never overtaken, while a crashed one
    #: delays the rest of its part by at most this long (its restarted self takes over at once).
    #: Each claim records its session, and whoever takes a lease over ends the holder's session
    #: first (``killSessions``): a committer killed inside a chunk transaction no longer blocks
    #: the marker for the server's transaction lifetime. Safety never depends on it.
    commit_lease_s: float = Field(60.0, ge=0.001, le=_MAX_S)
    #: The client's ``appName``, as the server's logs and ``currentOp`` show it.
    app_name: str = "twophase"

    @field_validator("uri")
    @classmethod
    def _check_uri(cls, value: SecretStr) -> SecretStr:
        """A ``mongodb://`` URI the driver parses (a ``mongodb+srv://`` one is resolved in DNS at
        connect, so only its scheme is checked here). The URI is never echoed: a password."""
        from pymongo.errors import ConfigurationError, InvalidURI
        from pymongo.uri_parser import parse_uri

        uri = value.get_secret_value()
        if uri.startswith("mongodb+srv://"):
            return value
        if not uri.startswith("mongodb://"):
            raise ValueError("expected a mongodb:// or mongodb+srv:// URI")
        try:
            # warn: an option the driver does not know is a warning to MongoClient too.
            parse_uri(uri, warn=True)
        except OSError:
            pass  # a tlsCAFile (...) not on this machine: the participant's to read, not ours
        except (InvalidURI, ConfigurationError, ValueError) as exc:
            said = str(exc).replace(uri, "<uri>")
            if (m := re.search(r"//[^:@/]*:([^@/]+)@", uri)) is not None:
                if len(m.group(1)) < 4:
                    said = type(exc).__name__  # too short to mask without mangling the text
                said = said.replace(m.group(1), "***")
            raise ValueError(f"not a MongoDB URI the driver reads: {said}") from None
        return value

    @field_validator("database")
    @classmethod
    def _check_database(cls, value: str) -> str:
        if not value or len(value.encode()) > 63 or _DB_NAME_FORBIDDEN.search(value):
            raise ValueError('use 1-63 bytes without / \\ . space " $')
        return value

    @field_validator("collection", "staging_collection", "marker_collection")
    @classmethod
    def _check_collection(cls, value: str | None) -> str | None:
        if value is not None and is_template(value):
            return check_template(value)
        if value is not None and (
            not value or "$" in value or "\x00" in value or value.startswith("system.")
        ):
            raise ValueError(
                "a collection name is non-empty, has no $ and does not start with system."
            )
        return value

    @field_validator("topic_replace")
    @classmethod
    def _check_topic_replace(
        cls, value: tuple[str, str] | None, info: ValidationInfo
    ) -> tuple[str, str] | None:
        return check_topic_replace(value, info.data.get("collection", ""))

    @field_validator("version_field")
    @classmethod
    def _check_version_field(cls, value: str | None) -> str | None:
        if value is not None and (
            not value or value.startswith("$") or "." in value or value == "_id"
        ):
            raise ValueError("a top-level field name without $ or '.', not _id")
        return value

    @field_validator("key")
    @classmethod
    def _check_key(cls, value: list[str], info: ValidationInfo) -> list[str]:
        mode = info.data.get("mode", "insert")
        if mode == "insert" and value:
            raise ValueError(
                "only used when mode is 'upsert' or 'update' (insert mode keys by record id)"
            )
        for name in value:
            if not name or name.startswith("$") or "." in name or "\x00" in name:
                raise ValueError(f"{name!r}: key fields are top-level field names without $ or '.'")
        if len(set(value)) != len(value):
            raise ValueError("key fields must be distinct")
        return value

    @property
    def templated(self) -> bool:
        """Whether ``collection`` is a template (a collection per topic or field value)."""
        return is_template(self.collection)

    @property
    def staging(self) -> str:
        if self.staging_collection:
            return self.staging_collection
        if self.templated:
            return f"twophase_staging_{self.name}"
        return f"{self.collection}__twophase_staging"
