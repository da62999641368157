"""The coordinator process: drives :class:`CoordinatorMachine` with Kafka.

Leadership: every coordinator of a pipeline joins the consumer group ``twophase.<pipeline>.
coordinator`` on the one-partition control topic. The member that owns the partition leads;
the others stand by. The leader then calls ``init_transactions`` with the pipeline's stable
``transactional.id``, which bumps the producer epoch and fences any earlier leader still running:
from then on, that zombie's writes fail with a fencing error and it steps down. Leadership
itself is therefore only a liveness device; safety comes from Kafka's fencing.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from confluent_kafka import (
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]

from twophase.config import PipelineConfig
from twophase.coordinator.machine import (
    Action,
    Alarm,
    CaughtUp,
    CoordinatorMachine,
    CoordinatorSettings,
    LeadershipAcquired,
    LeadershipLost,
    Log,
    Publish,
    Published,
    PublishFailed,
    Received,
    Skipped,
    SourcePartitions,
    StepDown,
    Tick,
)
from twophase.coordinator.stall import StallWatch
from twophase.errors import FatalError, FencedError, TwophaseError
from twophase.faults import crash_point
from twophase.kafka import (
    CALL_TIMEOUT_S,
    TOPIC_REFRESH_S,
    ControlPublisher,
    await_broker,
    check_control_topic,
    client_settings,
    note_broker_contact,
    raise_fatal,
    read_control,
    reply_reader,
)
from twophase.observability import HealthServer, Metrics, log_context, txn_extra
from twophase.protocol.codec import new_envelope
from twophase.protocol.messages import REPLIES, Checkpoint, Decision, Outcome, Payload, Prepare

__all__ = ["CoordinatorRuntime"]

log = logging.getLogger("twophase.coordinator")

#: Main-loop poll: the granularity of ticks, so of vote deadlines and commit intervals.
POLL_S = 0.02
#: Replies handed to the machine per pass of the loop, at most: the first is waited for (up to
#: POLL_S), the rest are what the reader holds already (a consume waits for its whole batch,
#: so it never waits here).
REPLIES_BATCH = 500
#: What a reply topic answers when it is not there (any more): it is stopped being read, and
#: read again once the metadata shows it.
REPLY_TOPIC_GONE = frozenset(
    {
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_TOPIC,
        KafkaError._UNKNOWN_PARTITION,
    }
)
#: The leader compares the source partitions' ends with its commits' positions this often
#: (more often when the stall alarm is set shorter).
STALL_CHECK_S = 10.0
#: A standby notices a dead leader after the group session times out; 10 s balances failover
#: time against false failovers during a long GC or I/O stall.
SESSION_TIMEOUT_MS = 10_000


def _now_ms() -> int:
    return int(time.time() * 1000)


def _crash_mid_decision() -> None:
    crash_point("mid_decision")  # DECISION produced, its Kafka transaction not yet committed


class CoordinatorRuntime:
    def __init__(
        self, cfg: PipelineConfig, *, instance: str = "", metrics: Metrics | None = None
    ) -> None:
        self.cfg = cfg
        self.instance = instance or cfg.participant_id
        self.sender = f"coordinator:{self.instance}"
        self.metrics = metrics or Metrics(cfg.pipeline, "coordinator")
        self.machine = CoordinatorMachine(
            CoordinatorSettings(
                commit_interval_ms=cfg.commit.interval_ms,
                vote_timeout_ms=cfg.commit.vote_timeout_ms,
                max_failed_cycles=cfg.commit.max_failed_cycles,
                checkpoint_every=cfg.commit.checkpoint_every,
                early_min_records=cfg.commit.early_min_records if cfg.commit.early_idle_ms else 0,
            )
        )
        self.health = HealthServer(self.metrics, ready=self._ready, status=self.status)
        self.stop_event = threading.Event()
        # Ready only once Kafka answered: a coordinator that cannot reach (or authenticate to)
        # the broker must not count as a healthy standby.
        self._reached_kafka = False
        self._assigned: bool | None = None  # set by the rebalance callbacks, read by the loop
        self._replaying = False
        self._replay_end = 0
        self._fenced = False
        self.publisher: ControlPublisher | None = None
        self.admin = AdminClient(client_settings(cfg, "admin"))
        # Never subscribes: it only lends the source group's metadata to
        # send_offsets_to_transaction, so commit decisions move the group's offsets atomically.
        # The classic protocol matters: with group.protocol=consumer librdkafka invents a member
        # id, and the broker rejects the transactional offset commit as UNKNOWN_MEMBER_ID.
        self.group_handle = Consumer(
            client_settings(
                cfg,
                "group-handle-consumer",
                **{"group.id": cfg.group_id, "group.protocol": "classic"},
            )
        )
        self.consumer = Consumer(
            client_settings(
                cfg,
                "leadership",
                **{
                    "group.id": cfg.coordinator_group_id,
                    "enable.auto.commit": False,
                    "isolation.level": "read_committed",
                    "enable.partition.eof": True,
                    "auto.offset.reset": "earliest",
                    "session.timeout.ms": SESSION_TIMEOUT_MS,
                    # A standby joining must not move the partition away from a healthy leader
                    # (each move costs a presumed abort).
                    "partition.assignment.strategy": "cooperative-sticky",
                    "heartbeat.interval.ms": SESSION_TIMEOUT_MS // 4,
                },
            )
        )
        self._pending_decision_start: dict[int, float] = {}
        self.stalls = StallWatch(cfg.commit.stall_alarm_s)
        self._stall_every = max(0.5, min(STALL_CHECK_S, cfg.commit.stall_alarm_s / 3))
        self._next_stall_check = 0.0
        #: The end-offset requests in flight (the loop never blocks on them).
        self._stall_query: tuple[dict[TopicPartition, Future[Any]], ...] = ()
        #: Whether the last metadata showed the reply topic (``control.reply_topic``).
        self._reply_topic_found = False
        #: This reign may not read it (authorization refused): not tried again until the next.
        self._replies_refused = False
        #: Partition 0 of the reply topic, read while this process leads once recovered; its
        #: name goes in every message we write (``reply_to``). None: replies come on the
        #: control topic only (no reply topic, or not leading).
        self._replies: Consumer | None = None
        #: The next reply offset to hand to the machine: a CHECKPOINT reflects every one below,
        #: and a reader opened again mid-reign starts there.
        self._replies_next = 0
        #: Whether _replies_next is where the reader is: not after a reopen mid-reign until a
        #: reply is read (the topic may have been made again, its offsets starting over).
        self._replies_known = False
        #: ``replies_from`` of the latest CHECKPOINT replayed that names our reply topic.
        self._replies_checkpointed = -1

    # -- status --------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        m = self.machine
        return {
            "role": "coordinator",
            "instance": self.instance,
            "pipeline": self.cfg.pipeline,
            "reached_kafka": self._reached_kafka,
            "leader": m.is_leader,
            "phase": m.phase.value,
            "current_txn": m.current_txn,
            "last_txn": m.log.last_txn,
            "last_decided": m.log.last_decided,
            "committed": m.committed,
            "aborted": m.aborted,
            "early_cycles": m.early_cycles,  # started before the interval: DRAINED hints
            "failed_cycles": m.failed_cycles,
            "alarm": m.alarm,
            "last_commit_age_s": round(time.time() - m.last_commit_ms / 1000, 3)
            if m.last_commit_ms
            else None,
            "pending_commits": sorted(m.log.pending),
            "positions": {f"{t}[{p}]": o for (t, p), o in sorted(m.log.positions.items())},
            "stalled_partitions": {
                f"{t}[{p}]": self.stalls.last.stalled_s[(t, p)]
                for t, p in sorted(self.stalls.last.alarmed)
            }
            if self.stalls.last is not None
            else {},
        }

    # -- the loop ------------------------------------------------------------------------------

    def _ready(self) -> bool:
        return self._reached_kafka or self.machine.is_leader

    def _reached(self) -> None:
        self._reached_kafka = True
        note_broker_contact()

    def run(self) -> None:
        # Everything inside the try: however the run ends -- a port in use (ConfigError naming
        # metrics.port), a broker refusing our credentials, a fatal error in the loop -- the
        # Kafka clients and the health server are closed before the process goes on to exit
        # (a consumer left to the interpreter's exit can call back into it as it is torn down).
        try:
            self.health.start(self.cfg.metrics.host, self.cfg.metrics.port)
            # Fails fast (BrokerAuthError) when the broker refuses our credentials; a broker
            # that is merely down is waited for by the loop below, as before.
            if await_broker(self.admin, CALL_TIMEOUT_S, self.stop_event):
                self._reached()
                check_control_topic(self.cfg, self.admin)
            else:
                log.warning("Kafka at %s is not answering yet", self.cfg.kafka.bootstrap_servers)
            self.consumer.subscribe(
                [self.cfg.control_topic], on_assign=self._on_assign, on_revoke=self._on_revoke
            )
            self._refresh_partitions()
            next_refresh = time.monotonic() + TOPIC_REFRESH_S
            log.info(
                "coordinator %s for pipeline %s waiting for leadership",
                self.instance,
                self.cfg.pipeline,
            )
            while not self.stop_event.is_set():
                self.health.beat()
                # Reading replies, the loop waits on them (votes are what a cycle waits for);
                # the control topic is then looked at between waits.
                msg = self.consumer.poll(POLL_S if self._replies is None else 0)
                self._on_leadership_change()
                if msg is not None:
                    self._on_message(msg)
                if self._replies is not None:
                    self._read_replies(0 if msg is not None else POLL_S)
                self._execute(self.machine.handle(Tick(_now_ms())))
                if time.monotonic() >= next_refresh:
                    next_refresh = time.monotonic() + TOPIC_REFRESH_S
                    self._refresh_partitions()
                self._watch_stalls()
        finally:
            self.close()

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        """Close both consumers, flush the publisher and stop the health server; one that
        raises (after a fatal error, or an error callback served as it closes) is logged and
        does not keep the others open. The admin client has no close: the CLI lets the runtime
        go before the process exits."""
        closers = [self.consumer.close, self.group_handle.close]
        if self._replies is not None:
            closers.append(self._replies.close)
        if self.publisher is not None:
            closers.append(self.publisher.close)
        for close in closers:
            try:
                close()
            except (KafkaException, RuntimeError, TwophaseError) as exc:
                log.info("closing a Kafka client: %s", exc)
        self.health.stop()
        self.metrics.leader.labels(self.cfg.pipeline).set(0)

    # -- leadership ----------------------------------------------------------------------------

    # Cooperative rebalancing: callbacks carry only what changed, so an empty list is no news.
    def _on_assign(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._reached()  # the group join succeeded, with or without the control partition
        if partitions:
            self._assigned = True

    def _on_revoke(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if partitions:
            self._assigned = False

    def _on_leadership_change(self) -> None:
        change, self._assigned = self._assigned, None
        if change is None:
            return
        if change and not self.machine.is_leader:
            self._become_leader()
        elif not change and self.machine.is_leader:
            self._execute(
                self.machine.handle(LeadershipLost(_now_ms(), "control partition revoked"))
            )

    def _become_leader(self) -> None:
        # Bumps the epoch: any earlier holder of this transactional.id is fenced from here on,
        # and a transaction it left open is aborted by the broker.
        self.publisher = ControlPublisher(self.cfg, "coordinator-producer")
        self.metrics.leader.labels(self.cfg.pipeline).set(1)
        log.info("coordinator %s is now the leader of %s", self.instance, self.cfg.pipeline)
        self._replaying = True
        self._close_replies()  # a new reign reads from its own recovery's point
        self._replies_checkpointed = -1
        self._replies_refused = False
        # Recovery reads up to the end as of now (or an end-of-partition event, if sooner): on
        # a busy control topic the reader may never sit exactly at the moving end.
        tp = TopicPartition(self.cfg.control_topic, 0)
        self._replay_end = self.consumer.get_watermark_offsets(tp, timeout=CALL_TIMEOUT_S)[1]
        self._execute(self.machine.handle(LeadershipAcquired(_now_ms())))
        self._refresh_partitions()

    def _replayed_to_end(self) -> bool:
        tp = TopicPartition(self.cfg.control_topic, 0)
        return self.consumer.position([tp])[0].offset >= self._replay_end

    def _caught_up(self) -> None:
        self._replaying = False
        # Before the machine writes anything: what it writes names the reply topic.
        self._replies_next = max(0, self._replies_checkpointed)
        self._replies_known = True
        self._open_replies()
        self._execute(self.machine.handle(CaughtUp(_now_ms())))

    # -- replies -------------------------------------------------------------------------------

    def _open_replies(self) -> None:
        """Start reading the reply topic (leading, recovered, the topic there): from the latest
        replayed CHECKPOINT's ``replies_from`` -- replies below it are in the checkpoint --
        else from its start. Replies written before are harmless: a vote for a decided cycle
        is ignored, an APPLIED acknowledges what it did. Not found: replies stay on the control
        topic (the participants send them where our messages say), looked for again with the
        source topics."""
        if (
            self._replies is not None
            or self._replies_refused
            or not self.machine.is_leader
            or self._replaying
        ):
            return
        topic = self.cfg.reply_topic
        if not self._reply_topic_found:
            log.warning(
                "reply topic %s not found: participants send their votes to the control topic, "
                "which every participant then reads (`twophase topics create` makes it)",
                topic,
            )
            return
        # Assigned at an offset, not asked for the topic's bounds: nothing here waits for a
        # broker on the loop that ticks the cycles. An offset retention removed (or one past
        # the end of a topic made again) is read from the start (auto.offset.reset).
        start = self._replies_next
        replies = reply_reader(self.cfg)
        replies.assign([TopicPartition(topic, 0, start)])
        self._replies = replies
        log.info("reading replies from %s[0] at offset %d", topic, start)

    def _drop_replies(self, why: str) -> None:
        """Stop reading a reply topic that cannot be read: the messages we write name it no
        more, so the participants reply on the control topic again."""
        log.warning(
            "reply topic %s cannot be read (%s): replies go to the control topic",
            self.cfg.reply_topic,
            why,
        )
        self._close_replies()
        self._replies_known = False

    def _close_replies(self) -> None:
        replies, self._replies = self._replies, None
        if replies is not None:
            try:
                replies.close()
            except (KafkaException, RuntimeError) as exc:
                log.info("closing the replies consumer: %s", exc)

    def _read_replies(self, wait_s: float) -> None:
        """Hand the machine the next reply -- waiting up to ``wait_s`` for it -- and those the
        reader holds behind it (a new leader may have many to read from a checkpoint)."""
        replies = self._replies
        first = replies.poll(wait_s) if replies is not None else None
        if first is None or replies is None:
            return
        for reply in [first, *replies.consume(REPLIES_BATCH - 1, 0)]:
            if self._replies is None:
                return  # dropped by the one before: the rest is not ours to read
            self._on_reply(reply)

    def _on_reply(self, msg: Message) -> None:
        err = msg.error()
        if err is not None:
            if err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                self._replies_refused = True  # not to be tried again while we lead
                self._drop_replies(err.str())
            elif err.code() in REPLY_TOPIC_GONE:
                self._drop_replies(err.str())  # found again with the source topics, if made
            elif err.code() != KafkaError._PARTITION_EOF:
                raise_fatal(err)
            return
        note_broker_contact()
        self._replies_next = (msg.offset() or 0) + 1
        self._replies_known = True
        env = read_control(self.cfg, msg, self._count_skipped)
        if env is None:
            return
        if not isinstance(env.payload, REPLIES):
            # Only participants' replies belong here: a coordinator's message or a DRAINED on
            # the reply topic is no one's to act on.
            log.warning(
                "skipping %s at %s[0]@%s: only VOTE and APPLIED belong on the reply topic",
                env.type.name,
                msg.topic(),
                msg.offset(),
            )
            self._count_skipped("misplaced")
            return
        self._execute(self.machine.handle(Received(env, _now_ms())))

    # -- messages ------------------------------------------------------------------------------

    def _on_message(self, msg: Message) -> None:
        note_broker_contact()
        err = msg.error()
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                if self._replaying:
                    self._caught_up()
                return
            raise_fatal(err)
            return
        env = read_control(self.cfg, msg, self._count_skipped)
        if env is None:
            return
        if self._replaying and isinstance(env.payload, Checkpoint):
            # The log's order is the checkpoints' order: the last one read is the newest.
            here = env.reply_to == self.cfg.reply_topic and env.payload.replies_from >= 0
            self._replies_checkpointed = env.payload.replies_from if here else -1
        self._execute(self.machine.handle(Received(env, _now_ms())))
        if self._replaying and self._replayed_to_end():
            self._caught_up()

    def _count_skipped(self, kind: str) -> None:
        self.metrics.control_skipped.labels(self.cfg.pipeline, kind).inc()

    # -- actions -------------------------------------------------------------------------------

    def _execute(self, actions: list[Action]) -> None:
        queue = list(actions)
        while queue:
            action = queue.pop(0)
            if isinstance(action, Publish):
                queue.extend(self._publish(action.payload))
            elif isinstance(action, Log):
                getattr(log, action.level)(
                    "%s%s",
                    f"txn={action.txn} " if action.txn else "",
                    action.message,
                    extra=self._txn_extra(action.txn) if action.txn else self._extra,
                )
            elif isinstance(action, Skipped):
                self.metrics.control_skipped.labels(self.cfg.pipeline, action.kind).inc()
                log.warning(
                    "txn=%d skipping control message: %s: %s",
                    action.txn,
                    action.kind,
                    action.message,
                    extra=self._txn_extra(action.txn),
                )
            elif isinstance(action, Alarm):
                self.metrics.alarm.labels(self.cfg.pipeline).set(1 if action.active else 0)
                if action.active:
                    log.error("ALARM %s", action.message, extra=self._extra)
                else:
                    log.info("alarm cleared: %s", action.message)
            elif isinstance(action, StepDown):
                self.metrics.leader.labels(self.cfg.pipeline).set(0)
                self._drop_producer()
                self._close_replies()
                if self._fenced:
                    # Still owning the control partition, this process would keep a newer leader's
                    # standby from taking over; exit and come back as a fresh group member.
                    raise FencedError(f"coordinator {self.instance}: {action.reason}")

    def _drop_producer(self) -> None:
        self.publisher = None

    @property
    def _extra(self) -> dict[str, Any]:
        return {"pipeline": self.cfg.pipeline}

    def _txn_extra(self, txn: int) -> dict[str, Any]:
        """Log fields of a line about ``txn``: a cycle covers every source partition (the
        decision's positions name them once it is committed)."""
        decision = self.machine.log.decisions.get(txn)
        if decision is not None and decision.positions:
            tps = [(p.topic, p.partition) for p in decision.positions]
        else:
            tps = list(self.machine.partitions)
        return txn_extra(txn, tps, **self._extra)

    def _publish(self, payload: Payload) -> list[Action]:
        if isinstance(payload, (Prepare, Decision)):
            with log_context(self._txn_extra(payload.txn)):
                return self._publish_now(payload)
        return self._publish_now(payload)

    def _publish_now(self, payload: Payload) -> list[Action]:
        now = _now_ms
        publisher = self.publisher
        if publisher is None:
            return self.machine.handle(PublishFailed(payload, now(), "no producer", fenced=True))
        if self._replies is not None and isinstance(payload, Checkpoint):
            # Unknown: none, and a later leader reads the reply topic from its start.
            payload = replace(
                payload, replies_from=self._replies_next if self._replies_known else -1
            )
        env = new_envelope(self.cfg.pipeline, self.sender, payload)
        if self._replies is not None:
            env = replace(env, reply_to=self.cfg.reply_topic)
        offsets: list[TopicPartition] = []
        group: Consumer | None = None
        if isinstance(payload, Decision) and payload.outcome is Outcome.COMMIT:
            # A commit decision moves the source group's offsets in the same Kafka transaction.
            offsets = [TopicPartition(p.topic, p.partition, p.offset) for p in payload.positions]
            group = self.group_handle
        started = time.monotonic()
        result = publisher.publish(
            env,
            offsets=offsets,
            group=group,
            before_commit=_crash_mid_decision if isinstance(payload, Decision) else None,
        )
        if result.error:
            if result.fenced:
                self._fenced = True
                self.metrics.fenced.labels(self.cfg.pipeline).inc()
                log.error(
                    "%sfenced while publishing %s: %s",
                    f"txn={payload.txn} " if isinstance(payload, (Prepare, Decision)) else "",
                    type(payload).__name__,
                    result.error,
                )
            return self.machine.handle(
                PublishFailed(payload, now(), result.error, fenced=result.fenced)
            )
        if isinstance(payload, (Prepare, Decision)):
            crash_point("after_decision" if isinstance(payload, Decision) else "after_prepare_sent")
        self._observe(payload, time.monotonic() - started)
        if isinstance(payload, Checkpoint) and result.offset is not None:
            # Readers start at the latest checkpoint: the coordinator group's offset points at it.
            # Only a shortcut for them (the checkpoint itself is written), so a commit the
            # coordinators' group refuses -- a standby joining mid-commit makes it
            # ILLEGAL_GENERATION, seen in a chaos run, where it ended the leader -- is left to
            # the next checkpoint.
            try:
                self.consumer.commit(
                    offsets=[TopicPartition(self.cfg.control_topic, 0, result.offset)],
                    asynchronous=False,
                )
            except KafkaException as exc:
                err = exc.args[0]
                if not isinstance(err, KafkaError) or err.fatal():
                    raise
                log.warning(
                    "checkpoint at control offset %d: its group offset was not committed (the "
                    "next checkpoint's will be): %s",
                    result.offset,
                    err.str(),
                )
        return self.machine.handle(Published(payload, now()))

    def _observe(self, payload: Payload, write_s: float) -> None:
        p = self.cfg.pipeline
        if isinstance(payload, Prepare):
            self._pending_decision_start[payload.txn] = time.monotonic() - write_s
        elif isinstance(payload, Decision):
            self.metrics.cycles.labels(p, payload.outcome.value).inc()
            self.metrics.cycle_seconds.labels(p, "decision_write").observe(write_s)
            started = self._pending_decision_start.pop(payload.txn, None)
            if started is not None:
                self.metrics.cycle_seconds.labels(p, "prepare_to_decision").observe(
                    time.monotonic() - started
                )
            if payload.outcome is Outcome.COMMIT:
                self.metrics.last_commit.labels(p).set(time.time())

    # -- source partitions ---------------------------------------------------------------------

    def _refresh_partitions(self) -> None:
        # Clients the loop never polls: serve their error and log callbacks here.
        self.admin.poll(0)
        self.group_handle.poll(0)
        try:
            md = self.admin.list_topics(timeout=CALL_TIMEOUT_S)
        except KafkaException as exc:
            log.warning("cannot read source topic metadata: %s", exc.args[0].str())
            return
        self._reached()
        reply = md.topics.get(self.cfg.reply_topic)
        self._reply_topic_found = reply is not None and reply.error is None
        if self._replies is None and self._reply_topic_found:
            self._open_replies()  # made since we took over, or back
        elif self._replies is not None and not self._reply_topic_found:
            self._drop_replies("not in the topic metadata")
        tps: set[tuple[str, int]] = set()
        for topic in self.cfg.source_topics:
            t = md.topics.get(topic)
            if t is None or t.error is not None:
                raise FatalError(
                    f"source topic {topic} does not exist (run `twophase topics create`)"
                )
        for topic in self.cfg.resolve_topics(md.topics):
            if (t := md.topics[topic]).error is None:  # one being created or deleted: next time
                tps.update((topic, p) for p in t.partitions)
        if self.cfg.has_topic_patterns and tps != self.machine.partitions:
            log.info("source partitions: %s", _fmt_topics(tps))
        try:
            committed = self.group_handle.committed(
                [TopicPartition(t, p) for t, p in sorted(tps)], timeout=CALL_TIMEOUT_S
            )
        except KafkaException as exc:  # e.g. NOT_COORDINATOR while the group coordinator moves
            log.warning("cannot read the source group's offsets: %s", exc.args[0].str())
            return
        offsets = {(c.topic, c.partition): c.offset for c in committed if c.offset >= 0}
        self._execute(self.machine.handle(SourcePartitions(frozenset(tps), offsets)))

    # -- stalled partitions --------------------------------------------------------------------

    def _watch_stalls(self) -> None:
        """Leader only, and never blocking the loop: ask Kafka where the source partitions end;
        once it has answered, compare with the positions the commits cover (:mod:`stall`)."""
        if not self.machine.is_leader or self._replaying or not self.machine.partitions:
            if self.stalls.last is not None or self._stall_query:
                self._stall_query = ()
                self.stalls.reset()
                self.metrics.stalled.labels(self.cfg.pipeline).set(0)
                self.metrics.stalled_seconds.clear()
        elif not self._stall_query:
            if time.monotonic() >= self._next_stall_check:
                self._next_stall_check = time.monotonic() + self._stall_every
                self._ask_source_ends()
        elif all(f.done() for q in self._stall_query for f in q.values()):
            self._observe_stalls()

    def _ask_source_ends(self) -> None:
        """Request each source partition's last stable offset, and the earliest offset of those
        nothing has committed yet (where reading starts)."""
        known = self.machine.committed_positions()
        tps = sorted(self.machine.partitions)
        fresh = [(t, p) for t, p in tps if (t, p) not in known]
        latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]
        earliest = OffsetSpec.earliest()  # type: ignore[no-untyped-call]
        try:
            ends = self.admin.list_offsets(
                {TopicPartition(t, p): latest for t, p in tps},
                isolation_level=IsolationLevel.READ_COMMITTED,
                request_timeout=CALL_TIMEOUT_S,
            )
            starts = (
                self.admin.list_offsets(
                    {TopicPartition(t, p): earliest for t, p in fresh},
                    request_timeout=CALL_TIMEOUT_S,
                )
                if fresh
                else {}
            )
        except KafkaException as exc:
            log.warning("cannot ask for the source partitions' ends: %s", exc.args[0].str())
            return
        self._stall_query = (ends, starts)

    def _observe_stalls(self) -> None:
        """Kafka has answered :meth:`_ask_source_ends`: update the watch, metrics and logs."""
        ends_done, starts_done = self._stall_query
        self._stall_query = ()
        try:
            ends = {(tp.topic, tp.partition): int(f.result().offset) for tp, f in ends_done.items()}
            starts = {
                (tp.topic, tp.partition): int(f.result().offset) for tp, f in starts_done.items()
            }
        except KafkaException as exc:
            log.warning("cannot read the source partitions' ends: %s", exc.args[0].str())
            return
        positions = {**starts, **self.machine.committed_positions()}
        report = self.stalls.observe(time.monotonic(), positions, ends)
        p = self.cfg.pipeline
        for (topic, partition), seconds in report.stalled_s.items():
            self.metrics.stalled_seconds.labels(p, topic, str(partition)).set(seconds)
        self.metrics.stalled.labels(p).set(len(report.alarmed))
        for topic, partition in sorted(report.raised):
            behind = ends[(topic, partition)] - positions.get((topic, partition), 0)
            log.error(
                "stall alarm: source partition %s[%d] has %d records waiting and no commit has "
                "moved its position for %.0fs (commit.stall_alarm_s %.0f): is a participant "
                "stuck? Its owner votes but does not read.",
                topic,
                partition,
                behind,
                report.stalled_s[(topic, partition)],
                self.cfg.commit.stall_alarm_s,
                extra={"topic": topic, "partition": partition},
            )
        for topic, partition in sorted(report.cleared):
            log.info(
                "stall alarm cleared: source partition %s[%d] is moving again",
                topic,
                partition,
                extra={"topic": topic, "partition": partition},
            )


def _fmt_topics(tps: set[tuple[str, int]]) -> str:
    counts: dict[str, int] = {}
    for t, _p in tps:
        counts[t] = counts.get(t, 0) + 1
    return ", ".join(f"{t} ({n})" for t, n in sorted(counts.items())) or "none"
