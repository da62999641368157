"""Kafka plumbing shared by the coordinator and the participants: client settings, the control
log reader and writers, topic creation, and the consumer group's generation.
"""

from __future__ import annotations

import concurrent.futures
import logging
import struct
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType  # type: ignore[attr-defined]
from confluent_kafka.cimpl import NewTopic

from twophase.config import PipelineConfig
from twophase.errors import ConfigError, FatalError, RetriableError
from twophase.logrepeat import CollapseRepeats
from twophase.protocol.codec import DecodeError, decode, encode, new_envelope
from twophase.protocol.messages import REPLIES, Envelope, Payload
from twophase.retry import KAFKA, KAFKA_RETRY_S, TXN_COMMIT, TXN_COMMIT_ATTEMPTS, Policy

__all__ = [
    "FENCED_ERRORS",
    "BrokerAuthError",
    "ControlPublisher",
    "ControlReader",
    "ControlWriter",
    "PublishResult",
    "await_broker",
    "check_control_topic",
    "client_settings",
    "commit_transaction",
    "create_topics",
    "group_generation",
    "note_broker_contact",
    "raise_fatal",
    "read_control",
]

log = logging.getLogger(__name__)
#: librdkafka's own log lines go through Python logging (so ``TWOPHASE_LOG_FORMAT=json`` stays
#: JSON); confluent-kafka serves them from the client's poll calls.
librdkafka_log = logging.getLogger("twophase.librdkafka")
#: How _on_error logs what librdkafka recovers from by itself (the lines that repeat).
_ERROR_CB_LINE = "Kafka: %s"
#: A broker that is down makes every client report every failed connect, several times a
#: second, through its log and its error_cb: repeats are collapsed into one line per interval.
_collapse_repeats = CollapseRepeats(
    applies=lambda r: r.name == librdkafka_log.name or r.msg == _ERROR_CB_LINE
)
librdkafka_log.addFilter(_collapse_repeats)
log.addFilter(_collapse_repeats)

#: How long a blocking Kafka call may take before we call it a failure. Broker restarts take
#: a few seconds; longer than this and the caller's own retry/abort logic should decide.
CALL_TIMEOUT_S = 30.0
#: Source topics and partitions are re-read from Kafka's metadata this often, by the coordinator
#: and by every participant: added partitions and new topics a ``topic_pattern`` matches join the
#: pipeline within this time.
TOPIC_REFRESH_S = 10.0
#: A handshake failure that could be a broker going down mid-handshake (a disconnect, an
#: unexpected EOF) is fatal only when it keeps coming, with no broker reached in between, for
#: this long: a broker restart lasts seconds, a wrong security.protocol lasts forever.
SUSPECT_AUTH_FATAL_S = 60.0
#: Suspect failures further apart than this start a new streak (librdkafka reconnects a
#: failing broker at least every reconnect.backoff.max.ms, 10 s by default).
SUSPECT_AUTH_GAP_S = 30.0
#: What Kafka answers a transactional producer once a newer holder of its transactional.id has
#: bumped the epoch: that producer can never write again.
FENCED_ERRORS = frozenset(
    {
        KafkaError._FENCED,
        KafkaError.PRODUCER_FENCED,
        KafkaError.INVALID_PRODUCER_EPOCH,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    }
)


def _fencing(err: KafkaError) -> bool:
    """Whether ``err`` says this transactional producer can never write again."""
    return err.fatal() or err.code() in FENCED_ERRORS


#: Delivery errors of a control message that no wait mends: this client may not write the
#: control topic, or the message can never fit.
PERMANENT_DELIVERY_ERRORS = frozenset(
    {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.RECORD_LIST_TOO_LARGE,
    }
)

T = TypeVar("T")

_SASL_HINT = "check kafka.config security.protocol, sasl.mechanism, sasl.username, sasl.password"
_SSL_HINT = (
    "check kafka.config security.protocol and ssl.* "
    "(ssl.ca.location, ssl.certificate.location, ssl.key.location)"
)
#: OpenSSL reasons that no retry can fix: the peer rejected us or we rejected the peer.
_SSL_DEFINITE = (
    "certificate verify failed",
    "wrong version number",
    "unknown ca",
    "bad certificate",
    "certificate required",
    "certificate unknown",
    "certificate expired",
    "alert handshake failure",
    "no shared cipher",
    "unsupported protocol",
    "unexpected message",
)


class BrokerAuthError(FatalError):
    """The broker refused this client (authentication or TLS): retrying cannot help."""


class _BrokerAccess:
    """Process-wide: whether Kafka was reached, and the streak of suspect handshake failures.

    Every client shares it (one process, one set of credentials), so a success on any client
    clears a streak seen by another.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.last_contact = 0.0  # monotonic; 0: never
        self.suspect_since = 0.0
        self.suspect_last = 0.0
        self.failed: BrokerAuthError | None = None  # raised once; later callbacks stay quiet

    def contact(self) -> None:
        with self.lock:
            self.last_contact = time.monotonic()
            self.suspect_since = 0.0

    def suspect(self) -> bool:
        """Record a suspect failure; True once the streak has lasted long enough to be fatal."""
        now = time.monotonic()
        with self.lock:
            if not self.suspect_since or now - self.suspect_last > SUSPECT_AUTH_GAP_S:
                self.suspect_since = now
            self.suspect_last = now
            return now - self.suspect_since >= SUSPECT_AUTH_FATAL_S


_access = _BrokerAccess()


def note_broker_contact() -> None:
    """A Kafka request just succeeded: suspect handshake failures before it were transient."""
    _access.contact()


def _auth_failure(err: KafkaError) -> tuple[bool, str] | None:
    """(definite, hint) when ``err`` is the broker refusing this client, else None.

    librdkafka itself retries these forever; a Java client would throw. Definite: SASL
    authentication (the broker said no) and TLS failures no retry can fix. Suspect: a TLS
    handshake cut short, or a disconnect librdkafka blames on security.protocol -- exactly what
    a broker that is restarting can look like.
    """
    text = (err.str() or "").lower()
    if err.code() == KafkaError._AUTHENTICATION:
        return True, _SASL_HINT
    if err.code() == KafkaError._SSL:
        return any(m in text for m in _SSL_DEFINITE), _SSL_HINT
    if err.code() == KafkaError._TRANSPORT and (
        "ssl handshake failed" in text or "sasl" in text or "security.protocol" in text
    ):
        return False, _SSL_HINT if "ssl" in text else _SASL_HINT
    return None


#: What a client refused by the broker reports besides the refusal itself.
_REFUSAL_ECHOES = frozenset({KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT})


def _on_error(err: KafkaError) -> None:
    """librdkafka's ``error_cb``, served from the client's poll/flush/consume calls.

    Authentication and TLS failures become :class:`BrokerAuthError`, raised out of that call,
    so the process stops with one line that says what to check. Everything else (a broker
    restarting, all brokers down) librdkafka recovers from by itself: logged only.
    """
    found = _auth_failure(err)
    if _access.failed is not None and (found is not None or err.code() in _REFUSAL_ECHOES):
        # Refused already: the clients repeat it as they close (or a driver's next query
        # starts) -- said once, as the error raised. Anything else is still logged.
        log.debug("Kafka, after the refusal: %s", err.str())
        return
    if found is None:
        if err.fatal():
            log.error("Kafka: %s", err.str())  # surfaces again from the failing call
        else:
            log.warning(_ERROR_CB_LINE, err.str())
        return
    definite, hint = found
    if not definite and not _access.suspect():
        log.warning("Kafka: %s (retrying; if it persists, %s)", err.str(), hint)
        return
    with _access.lock:
        if _access.failed is not None:
            return
        _access.failed = BrokerAuthError(f"Kafka refused this client: {err.str()} -- {hint}")
        failure = _access.failed
    raise failure


def client_settings(
    cfg: PipelineConfig, role: str, defaults: dict[str, Any] | None = None, /, **extra: Any
) -> dict[str, Any]:
    """librdkafka settings for one client: ours and ``defaults``, then the user's passthrough,
    then ``extra``.

    Every client reports errors through :func:`_on_error` and logs through Python logging.
    """
    base: dict[str, Any] = {
        "bootstrap.servers": cfg.kafka.bootstrap_servers,
        "client.id": f"twophase-{cfg.pipeline}-{role}",
        "error_cb": _on_error,
        "logger": librdkafka_log,
        **(defaults or {}),
    }
    base.update(cfg.kafka.config)
    if role.endswith("consumer") or role in {"control-reader", "leadership"}:
        base.update(cfg.kafka.consumer)
    else:
        base.update(cfg.kafka.producer)
    base.update(extra)
    return base


def await_broker(
    admin: AdminClient, timeout_s: float = CALL_TIMEOUT_S, stop: threading.Event | None = None
) -> bool:
    """Wait until the cluster answers a metadata request (True) or ``timeout_s`` passes (False).

    A blocking librdkafka call (committed offsets, metadata) does not serve ``error_cb``: with a
    wrong password it would wait out its whole timeout and end in a bare _TIMED_OUT. Short
    requests with polls in between let an authentication failure stop the caller within about
    a second, as :class:`BrokerAuthError`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            admin.list_topics(timeout=1.0)
        except KafkaException:
            admin.poll(0.1)  # serves error_cb: raises BrokerAuthError when refused
            if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
                return False
            continue
        note_broker_contact()
        admin.poll(0)
        return True


def group_generation(consumer: Consumer) -> tuple[int, str]:
    """The consumer's group generation and member id.

    confluent-kafka hands the group metadata out as librdkafka's serialized ``CGMDv2`` blob:
    magic, int32 generation (host order), int16 member-id length, member id, ... .
    """
    blob = consumer.consumer_group_metadata()
    magic = b"CGMDv2:"
    if not isinstance(blob, bytes) or not blob.startswith(magic):
        raise FatalError("unsupported librdkafka group metadata format; cannot read the generation")
    off = len(magic)
    (generation,) = struct.unpack_from("=i", blob, off)
    (mlen,) = struct.unpack_from("=h", blob, off + 4)
    member = blob[off + 6 : off + 6 + max(mlen, 0)].decode(errors="replace")
    return int(generation), member


def commit_transaction(producer: Producer) -> None:
    """Commit the producer's transaction; librdkafka allows a commit that failed retriably
    (and needs no abort) to simply be retried -- a few tries, then ``RetriableError``."""
    TXN_COMMIT.call(
        lambda: producer.commit_transaction(CALL_TIMEOUT_S),
        "commit_transaction",
        attempts=TXN_COMMIT_ATTEMPTS,
        give_up=RetriableError,
        logger=log,
    )


def raise_fatal(err: KafkaError) -> None:
    """Consumer error events: fatal ones stop the process, the rest (a broker restarting, a
    connection reset) are logged -- librdkafka recovers from them by itself."""
    if err.code() == KafkaError._PARTITION_EOF:
        return
    if err.fatal():
        raise FatalError(f"Kafka: {err.str()}")
    log.warning("Kafka: %s", err.str())


def create_topics(
    cfg: PipelineConfig,
    *,
    timeout_s: float = CALL_TIMEOUT_S,
    only: Collection[str] | None = None,
) -> dict[str, str]:
    """Create the control, reply, dead-letter and source topics (or ``only`` those named) if
    missing, and wait until they are ready; returns topic -> outcome.

    Replication factors and min.insync.replicas are clamped to the broker count so the same
    config works on a one-broker laptop stack and a real cluster.
    """
    from twophase.protocol.topics import topic_settings

    admin = AdminClient(client_settings(cfg, "admin"))
    if not await_broker(admin, timeout_s):
        raise RetriableError(
            f"Kafka at {cfg.kafka.bootstrap_servers} did not answer within {timeout_s:.0f}s"
        )
    brokers = len(admin.list_topics(timeout=timeout_s).brokers)
    wanted = []
    for name, partitions, rf, conf in topic_settings(cfg):
        if only is not None and name not in only:
            continue
        rf = max(1, min(rf, brokers))
        conf = dict(conf)
        if "min.insync.replicas" in conf:
            conf["min.insync.replicas"] = str(
                max(1, min(int(conf["min.insync.replicas"]), rf - 1 or 1))
            )
        wanted.append(NewTopic(name, num_partitions=partitions, replication_factor=rf, config=conf))
    existing = set(admin.list_topics(timeout=timeout_s).topics)
    result = {t.topic: "exists" for t in wanted if t.topic in existing}
    todo = [t for t in wanted if t.topic not in existing]
    if todo:
        for topic, fut in admin.create_topics(todo, operation_timeout=timeout_s).items():
            try:
                fut.result()
                result[topic] = "created"
            except KafkaException as exc:
                if exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    result[topic] = "exists"
                else:
                    raise FatalError(f"cannot create topic {topic}: {exc.args[0].str()}") from None
    _wait_for_topics(admin, [t.topic for t in wanted], timeout_s)
    return result


def check_control_topic(
    cfg: PipelineConfig, admin: AdminClient, *, timeout_s: float = CALL_TIMEOUT_S
) -> None:
    """Refuse at start-up, as a :class:`ConfigError` naming ``control.topic``, a control topic
    the protocol cannot run on (``control-topic/topics.yaml``): more than one partition -- every
    reader reads partition 0, while a pipeline's messages go to the partition its key hashes
    to, and coordinators would each lead one -- or ``cleanup.policy`` with ``compact``: every
    control message of a pipeline carries the same key, so compaction would keep only the last
    one and recovery would find decisions gone. What cannot be checked now is logged, never
    raised: a topic not there yet (the readers wait for it), a broker that does not answer in
    time, settings this principal may not read (DescribeConfigs denied)."""
    topic = cfg.control_topic
    try:
        # All topics' metadata: asking for one topic by name may auto-create it.
        meta = admin.list_topics(timeout=timeout_s).topics.get(topic)
    except KafkaException as exc:
        log.warning("cannot check control topic %s now: %s", topic, exc)
        return
    if meta is None:
        return
    if meta.error is not None:
        log.warning("cannot check control topic %s now: %s", topic, meta.error)
        return
    if len(meta.partitions) != 1:
        raise ConfigError(
            "control.topic",
            f"topic {topic} has {len(meta.partitions)} partitions: the protocol needs exactly one. "
            "Name a new topic here (`twophase topics create` makes it with one) once `twophase "
            "txn list` shows nothing in doubt; deleting this one loses its decision log",
            source=cfg.source_file,
        )
    resource = ConfigResource(ResourceType.TOPIC, topic)
    try:
        # Python's wait outlasts librdkafka's own timeout, which ends the request first.
        entries = admin.describe_configs([resource], request_timeout=timeout_s)[resource].result(
            timeout=timeout_s + 5
        )
    except (KafkaException, concurrent.futures.TimeoutError) as exc:
        log.warning("cannot read control topic %s's settings: %s", topic, exc)
        return
    policy = entries.get("cleanup.policy")
    if policy is not None and "compact" in str(policy.value or ""):
        raise ConfigError(
            "control.topic",
            f"topic {topic} has cleanup.policy={policy.value}: compaction would keep one control "
            "message of the pipeline (they share a key) and lose its decisions; it must be "
            "'delete' (kafka-configs --alter --add-config cleanup.policy=delete)",
            source=cfg.source_file,
        )


def topic_max_message_bytes(
    cfg: PipelineConfig, topic: str, *, timeout_s: float = CALL_TIMEOUT_S
) -> int | None:
    """The ``max.message.bytes`` the broker enforces on ``topic`` (None when not found)."""
    admin = AdminClient(client_settings(cfg, "admin"))
    resource = ConfigResource(ResourceType.TOPIC, topic)
    futures = admin.describe_configs([resource], request_timeout=timeout_s)
    entries = futures[resource].result(timeout=timeout_s)
    entry = entries.get("max.message.bytes")
    return int(entry.value) if entry is not None and entry.value else None


def _wait_for_topics(admin: AdminClient, topics: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        md = admin.list_topics(timeout=timeout_s).topics
        if all(t in md and md[t].partitions and not md[t].error for t in topics):
            return
        time.sleep(0.1)
    raise RetriableError(f"topics not ready after {timeout_s}s: {topics}")


def read_control(
    cfg: PipelineConfig, msg: Message, on_skip: Callable[[str], None]
) -> Envelope | None:
    """The envelope a control-topic message carries, or None for one that does not count
    (unauthenticated, another pipeline's, malformed: PROTOCOL.md): such a message is logged,
    handed to ``on_skip`` by its kind (the caller counts it) and skipped, never raised."""
    raw = msg.headers()
    headers = (
        [(k, v if isinstance(v, bytes) or v is None else v.encode()) for k, v in raw]
        if isinstance(raw, list)
        else None
    )
    try:
        env: Envelope = decode(msg.value(), headers, key=cfg.hmac_key, pipeline=cfg.pipeline)
    except DecodeError as exc:
        log.warning(
            "skipping control message at %s[%s]@%s: %s",
            msg.topic(),
            msg.partition(),
            msg.offset(),
            exc,
        )
        on_skip(exc.kind)
        return None
    return env


@dataclass
class ControlReader:
    """Reads one pipeline's control partition: the tail from the latest checkpoint, then live.

    The coordinator group's committed offset on the control partition points at the latest
    CHECKPOINT (the coordinator commits it after writing one), so recovery reads a bounded tail.
    """

    cfg: PipelineConfig
    on_skip: Callable[[str], None] = lambda kind: None

    def __post_init__(self) -> None:
        self.consumer = Consumer(
            client_settings(
                self.cfg,
                "control-reader",
                **{
                    # Never joins the group; only reads the coordinator group's committed offset.
                    "group.id": self.cfg.coordinator_group_id,
                    "enable.auto.commit": False,
                    "isolation.level": "read_committed",
                    "enable.partition.eof": True,
                    "auto.offset.reset": "earliest",
                },
            )
        )
        self.tp = TopicPartition(self.cfg.control_topic, 0)
        # Right after a broker restart this fails (NOT_COORDINATOR) until the coordinator
        # group's new coordinator has loaded its offsets: retried, not fatal.
        try:
            committed = KAFKA.call(
                lambda: self.consumer.committed([self.tp], timeout=CALL_TIMEOUT_S),
                "reading the control topic's checkpoint offset",
            )[0].offset
        except BaseException:
            self.consumer.close()  # no reader to close it later
            raise
        start = committed if committed >= 0 else OFFSET_BEGINNING
        self.consumer.assign([TopicPartition(self.cfg.control_topic, 0, start)])
        self.at_end = False

    def poll(self, timeout_s: float) -> Envelope | None:
        msg = self.consumer.poll(timeout_s)
        if msg is None:
            return None
        err = msg.error()
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                note_broker_contact()
                self.at_end = True
                return None
            raise_fatal(err)
            return None
        note_broker_contact()
        return self._decode(msg)

    def _decode(self, msg: Message) -> Envelope | None:
        return read_control(self.cfg, msg, self.on_skip)

    def replay(self) -> Iterator[Envelope]:
        """Every message from the start point up to the end as of now (read_committed).

        Stops at the end offset taken when the replay starts, or at an end-of-partition event,
        whichever comes first: on a busy control topic the reader may never sit exactly at the
        moving end, so waiting for the event alone could never finish.
        """
        _low, end = KAFKA.call(
            lambda: self.consumer.get_watermark_offsets(self.tp, timeout=CALL_TIMEOUT_S),
            "reading the control topic's end offset",
        )
        while not self.at_end:
            env = self.poll(1.0)
            if env is not None:
                yield env
            if self._position() >= end:
                break

    def _position(self) -> int:
        pos = self.consumer.position([self.tp])[0].offset
        return pos if pos >= 0 else -1

    def close(self) -> None:
        self.consumer.close()


def reply_reader(cfg: PipelineConfig, **extra: Any) -> Consumer:
    """A consumer of the reply topic that never joins a group (assigned, never commits): the
    coordinator's while it leads, the CLI's. Only replies belong there (:data:`REPLIES`)."""
    return Consumer(
        client_settings(
            cfg,
            "replies-consumer",
            **{
                "group.id": cfg.coordinator_group_id,
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "auto.offset.reset": "earliest",
                **extra,
            },
        )
    )


#: What a write to a reply topic this process cannot use gets back (from produce() itself or
#: in its delivery report): the reply goes to the control topic instead (which the
#: coordinator reads too), and so do the later ones. Not a size refusal: that is the message's.
REPLY_TOPIC_UNUSABLE = frozenset(
    {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_TOPIC,
        KafkaError._UNKNOWN_PARTITION,
    }
)


class ControlWriter:
    """Participants' writes to the control topic: idempotent, acks=all, flushed per message.

    Replies (VOTE, APPLIED) go to :attr:`reply_to` when set -- the reply topic the latest
    coordinator message named, whose partition 0 its writer reads -- so that no participant
    reads its peers' replies; otherwise, and always for DRAINED (which peers read), to the
    control topic. A reply topic that refuses this process's writes (not there, not allowed)
    is given up -- its replies go to the control topic -- until a coordinator message names no
    reply topic (the coordinator gave it up too: one it names again is tried again)."""

    def __init__(self, cfg: PipelineConfig, sender: str, producer: Producer) -> None:
        self.cfg = cfg
        self.sender = sender
        self.producer = producer
        self._reply_to = ""
        #: A reply topic a write was refused by; set by a delivery report (any thread).
        self._unusable = ""

    @property
    def reply_to(self) -> str:
        return self._reply_to

    @reply_to.setter
    def reply_to(self, topic: str) -> None:
        """Set by the control thread from every coordinator message read (attribute stores:
        the threads that send read whole values)."""
        if not topic:
            self._unusable = ""
        self._reply_to = topic

    def envelope(self, payload: Payload) -> Envelope:
        return new_envelope(self.cfg.pipeline, self.sender, payload)

    def post(self, payload: Payload) -> None:
        """Produce an advisory message without waiting for it (DRAINED): a delivery that
        fails is logged and forgotten, and a full local queue drops it."""

        def on_delivery(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                log.info("advisory control message not delivered: %s", err.str())

        try:
            self._produce(payload, on_delivery)
        except BufferError:
            log.info("advisory control message dropped: the producer's queue is full")
        self.producer.poll(0)

    def _produce(
        self,
        payload: Payload,
        on_delivery: Callable[[KafkaError | None, Message], None],
        *,
        control: bool = False,
    ) -> Envelope:
        """Produce ``payload`` where it goes (``control``: to the control topic whatever the
        reply topic); the envelope, its ``reply_to`` naming the reply topic it went to."""
        env = self.envelope(payload)
        value, headers = encode(env, self.cfg.hmac_key)
        reply_to = self._reply_to if isinstance(payload, REPLIES) and not control else ""
        if reply_to and reply_to == self._unusable:
            reply_to = ""
        if reply_to:
            try:
                self.producer.produce(
                    reply_to,
                    value=value,
                    key=self.cfg.pipeline.encode(),
                    headers=list(headers),
                    on_delivery=partial(self._from_reply_topic, reply_to, on_delivery),
                    partition=0,  # the one the coordinator reads, however many it has
                )
                return replace(env, reply_to=reply_to)
            except KafkaException as exc:
                # librdkafka knows the topic refused or is missing: not even queued.
                if exc.args[0].code() not in REPLY_TOPIC_UNUSABLE:
                    raise
                self._give_up(reply_to, exc.args[0])
        self.producer.produce(
            self.cfg.control_topic,
            value=value,
            key=self.cfg.pipeline.encode(),
            headers=list(headers),
            on_delivery=on_delivery,
        )
        return env

    def _give_up(self, topic: str, err: KafkaError) -> None:
        if topic != self._reply_to or self._unusable == topic:
            return  # a topic no coordinator names now, or given up already: nothing to change
        self._unusable = topic
        log.error(
            "reply topic %s refused a reply (%s): replies go to the control topic until a "
            "coordinator names no reply topic (the coordinator reads both; make the topic, or "
            "allow this principal to write to it)",
            topic,
            err.str(),
        )

    def _from_reply_topic(
        self,
        topic: str,
        then: Callable[[KafkaError | None, Message], None],
        err: KafkaError | None,
        msg: Message,
    ) -> None:
        if err is not None and err.code() in REPLY_TOPIC_UNUSABLE:
            self._give_up(topic, err)
        then(err, msg)

    def send(
        self, payload: Payload, *, timeout_s: float = CALL_TIMEOUT_S, control: bool = False
    ) -> Envelope:
        """Write and flush ``payload``; the envelope sent, whose ``reply_to`` names the reply
        topic it went to ("": the control topic). A reply the reply topic refuses is sent to
        the control topic (``control``) at once."""
        errors: list[KafkaError] = []

        def on_delivery(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                errors.append(err)

        env = self._produce(payload, on_delivery, control=control)
        if self.producer.flush(timeout_s) > 0:
            raise RetriableError(f"control message not delivered within {timeout_s}s")
        if errors and env.reply_to and errors[0].code() in REPLY_TOPIC_UNUSABLE:
            return self.send(payload, timeout_s=timeout_s, control=True)
        if errors:
            err = errors[0]
            if err.fatal() or err.code() in PERMANENT_DELIVERY_ERRORS:
                # Waiting cannot help (the callers wait for Kafka as long as the process runs):
                # say so and end, rather than look healthy and never vote again.
                raise FatalError(f"control message refused by Kafka: {err.str()}")
            raise RetriableError(f"control message not delivered: {err.str()}")
        return env


@dataclass(frozen=True, slots=True)
class PublishResult:
    """How one :meth:`ControlPublisher.publish` went.

    Written: ``error`` is empty, ``offset`` is the message's (None when no delivery report came).
    Not written: ``error`` is Kafka's reason; ``fenced`` when a newer holder of the
    transactional.id took over (or the producer failed fatally), so this publisher can never
    write again; ``retriable`` when the same write may still succeed.
    """

    offset: int | None = None
    error: str = ""
    fenced: bool = False
    retriable: bool = True


class _PublishAgain(RetriableError):
    """One try of a publish that may succeed when tried again."""

    def __init__(self, result: PublishResult) -> None:
        super().__init__(result.error)
        self.result = result


#: A publish is tried again (up to the caller's number of tries) only when Kafka says the same
#: write may still succeed; a fenced or failed one goes back to the caller as its result.
PUBLISH = Policy(
    "control publish",
    lambda exc: isinstance(exc, _PublishAgain),
    KAFKA_RETRY_S,
    first_wait_s=0.05,
    max_wait_s=1.0,
)


#: ``send_offsets_to_transaction``'s own timeout: it takes milliseconds, or the seconds a group
#: coordinator takes to move to another broker; past this the decision is written again.
SEND_OFFSETS_TIMEOUT_S = 15.0
#: How long that call may take before the producer is taken for wedged: it can block far past
#: its timeout while the group coordinator moves (its coordinator request's deadline is never
#: checked, librdkafka #5456; a coordinator that left the metadata is not looked up again,
#: #5511 -- seen here when a three-broker cluster lost that node: the leader froze for minutes).
WEDGED_AFTER_S = SEND_OFFSETS_TIMEOUT_S + 10.0


class Wedged(RuntimeError):
    """A librdkafka call did not return within its bound (:func:`bounded`)."""


def bounded(call: Callable[[], T], seconds: float, what: str) -> T:
    """``call()`` on a thread of its own, waited for at most ``seconds``: its result or its
    exception, or :class:`Wedged` when it has not returned. A wedged call is left running on
    its (daemon) thread; the caller must stop using what it holds."""
    result: list[T] = []
    failure: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:  # noqa: BLE001 -- handed to the caller's thread
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name=f"bounded {what}", daemon=True).start()
    if not done.wait(seconds):
        raise Wedged(f"{what} did not return within {seconds:.0f}s")
    if failure:
        raise failure[0]
    return result[0]


class ControlPublisher:
    """The decider's writes to the control topic -- the coordinator leader's, or a Spark
    driver's: each message in its own Kafka transaction under the pipeline's stable
    ``transactional.id``, acks=all.

    Creating one calls ``init_transactions``, which bumps the producer epoch: every earlier
    holder of the id is fenced from then on, and a transaction it left open is aborted by the
    broker. A producer wedged in a call (:data:`WEDGED_AFTER_S`) is replaced the same way: the
    new one fences it, and its open transaction -- the write that never finished -- is aborted.
    """

    def __init__(self, cfg: PipelineConfig, role: str) -> None:
        self.cfg = cfg
        self.role = role
        # A producer left inside a wedged call stays referenced by that call's thread, and is
        # freed there once the call returns.
        # False while the producer must be replaced before the next write: wedged in a call, or
        # holding a transaction it could not abort.
        self._replaced = True
        self.producer = self._new_producer()

    def _new_producer(self) -> Producer:
        producer = Producer(
            client_settings(
                self.cfg,
                self.role,
                **{
                    "transactional.id": self.cfg.transactional_id,
                    "enable.idempotence": True,
                    "acks": "all",
                    "transaction.timeout.ms": 60_000,
                },
            )
        )
        producer.init_transactions(CALL_TIMEOUT_S)
        return producer

    def _replace_wedged(self, why: str) -> str:
        """Put a fresh producer (fencing the wedged one) in place; what to report. Where that
        fails, the next publish tries again before writing anything."""
        log.error("control producer wedged: %s; replacing it (the new one fences it)", why)
        self._replaced = False
        failed = self._ensure_producer()
        return f"{why}; " + (f"{failed} (tried again next time)" if failed else "producer replaced")

    def _ensure_producer(self) -> str:
        """A new producer in place of one that must go (:attr:`_replaced` false); why that
        failed, or ""."""
        if self._replaced:
            return ""
        try:
            self.producer = self._new_producer()
        except KafkaException as exc:
            return f"replacing a wedged producer failed: {exc.args[0].str()}"
        self._replaced = True
        return ""

    def publish(
        self,
        env: Envelope,
        *,
        attempts: int = 1,
        offsets: Sequence[TopicPartition] = (),
        group: Consumer | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> PublishResult:
        """Write ``env`` -- and with ``group``, commit ``offsets`` for that consumer's group --
        in one Kafka transaction. Up to ``attempts`` tries: a transaction Kafka asks to abort is
        aborted and tried again, a retriable failure tried again; a fenced producer, or any
        other failure, ends the tries. ``before_commit`` runs between the write and the commit
        (fault injection)."""
        value, headers = encode(env, self.cfg.hmac_key)
        if failed := self._ensure_producer():
            return PublishResult(error=failed)
        producer = self.producer
        delivered: list[int] = []

        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            if err is None:
                delivered.append(msg.offset() or 0)

        def attempt() -> PublishResult:
            delivered.clear()
            began = False
            try:
                producer.begin_transaction()
                began = True
                producer.produce(
                    self.cfg.control_topic,
                    value=value,
                    key=self.cfg.pipeline.encode(),
                    headers=list(headers),
                    on_delivery=on_delivery,
                )
                if group is not None:
                    metadata = group.consumer_group_metadata()
                    bounded(
                        lambda: producer.send_offsets_to_transaction(
                            list(offsets), metadata, SEND_OFFSETS_TIMEOUT_S
                        ),
                        WEDGED_AFTER_S,
                        "send_offsets_to_transaction",
                    )
                producer.flush(CALL_TIMEOUT_S)
                if before_commit is not None:
                    before_commit()
                commit_transaction(producer)
            except KafkaException as exc:
                err: KafkaError = exc.args[0]
                if _fencing(err):
                    return PublishResult(error=err.str(), fenced=True)
                abort = err.txn_requires_abort()
                result = PublishResult(error=err.str(), retriable=abort or err.retriable())
                if not began and err.code() == KafkaError._STATE:
                    self._replaced = False  # a transaction left open somehow: start afresh
                if began:
                    # Whatever failed, the transaction is never left open: the next
                    # begin_transaction would refuse ("Operation not valid in state
                    # InTransaction") for good -- seen when AddOffsetsToTxn met a killed
                    # transaction coordinator (Broker transport failure, neither abortable
                    # nor retriable).
                    refused = self._abort()
                    if refused is not None and _fencing(refused):
                        # The commit's own error need not say so (Kafka 4.1 answered a
                        # fenced EndTxn with UNKNOWN), the abort's does: a newer instance
                        # holds the transactional id. A new producer would fence it back.
                        return PublishResult(error=f"{err.str()}; {refused.str()}", fenced=True)
                if result.retriable:
                    raise _PublishAgain(result) from exc
                return result
            except RetriableError as exc:  # commit_transaction kept failing: tried enough
                self._abort()
                return PublishResult(error=str(exc))
            except Wedged as exc:  # the write did not happen: the caller tries it again
                return PublishResult(error=self._replace_wedged(str(exc)))
            return PublishResult(delivered[0] if delivered else None)

        try:
            return PUBLISH.call(attempt, "publishing a control message", attempts=attempts)
        except _PublishAgain as again:
            return again.result

    def _abort(self) -> KafkaError | None:
        """Abort the producer's open transaction; where that fails, the next publish starts
        from a new producer, whose init_transactions fences this one and has the broker abort
        the transaction. The abort's error, if it failed."""
        try:
            self.producer.abort_transaction(CALL_TIMEOUT_S)
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
            log.warning(
                "abort_transaction failed: %s; the next write starts from a new producer",
                err.str(),
            )
            self._replaced = False
            return err
        return None

    def close(self) -> None:
        """Serve what librdkafka still holds; every publish already waited for its own message,
        so a few seconds are plenty. A fenced producer (a fatal error) has nothing to serve and
        says so by raising from flush: closing it is no failure."""
        try:
            self.producer.flush(5)
        except KafkaException as exc:
            log.info("control producer closed after: %s", exc.args[0].str())
