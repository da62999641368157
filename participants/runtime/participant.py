"""The participant process. See the package docstring for the two-thread design."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from twophase.config import PipelineConfig
from twophase.errors import FatalError, RetriableError, TwophaseError
from twophase.faults import crash_point as _crash_point
from twophase.faults import delay_point, stalled
from twophase.kafka import (
    CALL_TIMEOUT_S,
    ControlReader,
    ControlWriter,
    await_broker,
    check_control_topic,
    client_settings,
    group_generation,
    raise_fatal,
)
from twophase.observability import HealthServer, Metrics, log_context, txn_extra
from twophase.participants.decoding import source_decoder
from twophase.participants.machine import (
    AbortPart,
    Action,
    Assigned,
    BeginPart,
    CaughtUp,
    CommitPart,
    Cut,
    Event,
    InDoubt,
    Log,
    PartApplied,
    ParticipantMachine,
    ParticipantSettings,
    PrepareDone,
    PrepareFailed,
    PreparePart,
    Quiet,
    Received,
    Revoked,
    Seek,
    SendApplied,
    SendDrained,
    SendVote,
    Skipped,
    Sweep,
    Thread,
    Tick,
    WillWrite,
    Written,
)
from twophase.participants.runtime.batch import (
    SOURCE_FETCH_DEFAULTS,
    SOURCE_GROUP_SETTINGS,
    Retractions,
    close_quietly,
    decoding,
    open_writers,
    quiet_gc,
    write_batch,
)
from twophase.participants.runtime.gaps import UnreadStarts
from twophase.participants.runtime.subscription import Subscription
from twophase.participants.sdk import (
    FatalSinkError,
    PartId,
    Sink,
    SinkError,
    UnknownPartError,
)
from twophase.protocol.messages import COORDINATOR_MESSAGES, Drained, Outcome, Prepare
from twophase.retry import KAFKA, STORE, STORE_WAIT_S

__all__ = ["ParticipantRuntime", "prepare_due"]

log = logging.getLogger("twophase.participant")
T = TypeVar("T")

#: Data-thread poll: short, so queued control actions (prepare, rewind) run promptly. A
#: consume waits this long unless it fills its batch: a PREPARE read meanwhile waits for it.
CONSUME_TIMEOUT_S = 0.05
#: ... so while a PREPARE is due -- from the first value before one interval after the last one
#: was read until it is read (or the second value after it was due), and for the second value
#: after a DRAINED -- the data thread takes what the consumer holds and waits on the control
#: thread instead, which wakes it with the PREPARE. The lead is the consume's wait: no consume
#: started before the window runs into the due time.
PREPARE_DUE_S = (CONSUME_TIMEOUT_S, 0.25)
#: Control-thread poll. A control message ends the wait at once; the timeout only sets how
#: often an idle control thread wakes (the sweep timer, a stop): 20 ms cost each of sixteen
#: participants 50 wake-ups a second on two shared cores (docs/benchmarks.md).
CONTROL_POLL_S = 0.1
#: Time one batch may take to write into every sink. A PREPARE waits for the batch in flight,
#: so this bounds how much of the vote timeout a slow store can eat; batches are sized to it.
BATCH_TARGET_S = 0.5
INITIAL_BATCH = 500
MIN_BATCH = 20
#: Decided parts waiting to be applied before consumption pauses: bounds staged data when a
#: store applies slower than Kafka delivers.
MAX_UNAPPLIED = 2
#: Lag is recomputed this often; it needs a watermark request per partition.
LAG_REFRESH_S = 5.0
#: A sweep describes the source group on the control thread, where waiting holds up votes (the
#: vote timeout is 10 s by default). A healthy broker answers in milliseconds; no answer within
#: this long means the broker is down, or the AdminClient is stuck (seen after a broker restart:
#: every later describe on that client timed out while a fresh client answered at once).
DESCRIBE_TIMEOUT_S = 3.0
#: librdkafka fails the request itself at DESCRIBE_TIMEOUT_S; this much more is the backstop for
#: a future it never completes.
DESCRIBE_GRACE_S = 0.5
#: Transactions whose parts' partitions are remembered for log lines: far more than are ever
#: open, prepared or being applied at once.
TXN_PARTITIONS_KEPT = 64


@dataclass(frozen=True, slots=True)
class _Forget:
    """Housekeeping for the apply worker: the sinks forget decided parts below ``before``."""

    before: int


@dataclass(frozen=True, slots=True)
class _AbortStale:
    """Housekeeping for the apply worker: abort parts that dead processes began and never
    prepared (:meth:`ParticipantRuntime._abort_stale`)."""


def _now_ms() -> int:
    return int(time.time() * 1000)


def prepare_due(now: float, prepare_seen: float, interval_s: float, drained_sent: float) -> bool:
    """Whether the next PREPARE is due (:data:`PREPARE_DUE_S`): from a little before one
    interval after the last one was read until it is read (or a little after it was due), and
    right after a DRAINED, this participant's or a peer's. (Monotonic seconds.)"""
    lead, grace = PREPARE_DUE_S
    due = prepare_seen + interval_s
    return due - lead <= now <= due + grace or now - drained_sent <= grace


class ParticipantRuntime:
    def __init__(
        self,
        cfg: PipelineConfig,
        *,
        participant_id: str = "",
        metrics: Metrics | None = None,
        sinks: Sequence[Sink] | None = None,
    ) -> None:
        self.cfg = cfg
        self.me = participant_id or cfg.participant_id
        self.metrics = metrics or Metrics(cfg.pipeline, "participant")
        self.sinks, self.producer, self.dlq = open_writers(cfg, self.me, self.metrics, sinks)
        self.decoder = source_decoder(cfg)
        self.sink_by_name = {s.name: s for s in self.sinks}
        self.machine = ParticipantMachine(
            ParticipantSettings(
                participant=self.me,
                sinks=tuple(self.sink_by_name),
                sweep_interval_ms=cfg.participant.sweep_interval_ms,
                keep_decided_txns=cfg.participant.keep_decided_txns,
            )
        )
        self.lock = threading.RLock()
        self.data_queue: queue.Queue[Action] = queue.Queue()
        #: Set with every action queued for the data thread (and at stop): while a PREPARE is
        #: due the data thread waits on it instead of in a consume, so the PREPARE wakes it.
        self._wake = threading.Event()
        self.apply_queue: queue.Queue[Action | _Forget | _AbortStale] = queue.Queue()
        #: Set while a forget is queued or running: a slow one is not queued again meanwhile.
        self._forgetting = threading.Event()
        #: Set while a sweep's abort of stale parts is queued or running (not queued twice).
        self._aborting_stale = threading.Event()
        self.stop_event = threading.Event()
        self.fatal: BaseException | None = None
        #: The control partition's reader, once run() has made one (closed by _close()).
        self._reader: ControlReader | None = None
        self.control = ControlWriter(cfg, f"participant:{self.me}", self.producer)
        # The client.id names the participant, so others can tell live owners from dead ones.
        self._client_id_prefix = f"twophase-{cfg.pipeline}-participant-"
        self.admin = self._new_admin()
        self.consumer = Consumer(
            client_settings(
                cfg,
                "source-consumer",
                SOURCE_FETCH_DEFAULTS,
                **{
                    "client.id": self._client_id_prefix + self.me,
                    "group.id": cfg.group_id,
                    "enable.auto.commit": False,
                    "enable.auto.offset.store": False,
                    "auto.offset.reset": "earliest",
                    "isolation.level": "read_committed",
                    **SOURCE_GROUP_SETTINGS,
                },
            )
        )
        self.subscription = Subscription(cfg, self.consumer, self._on_assign, self._on_revoke)
        self.health = HealthServer(
            self.metrics, ready=lambda: self.machine.ready, status=self.status
        )
        self._paused = False
        self._poisoned = False  # a write failed: read nothing until the rewind
        #: The part whose write failed: its PREPARE fails here, whatever the sinks would say --
        #: a write the runtime itself gave up (a record to retract) leaves every sink willing.
        self._failed_txn: int | None = None
        #: Records a later sink refused after earlier ones stored them: the rewind leaves them
        #: out (data thread only). Bounded; not pruned here, as commits reach the control thread
        #: without positions -- forgetting one early costs one more rewind, never a wrong result.
        self.retractions = Retractions()
        #: Partitions whose open part ended early: a sink held a record for a later part
        #: (:class:`Held`). Each is sought back to that record and paused until the part is
        #: cut, then read into the next part (data thread only).
        self._held: dict[tuple[str, int], int] = {}
        #: Seeks done on the data thread so far: records fetched before one are read again from
        #: the new position, so a batch in hand across a seek is dropped, never written.
        self._seeks = 0
        self._next_lag = 0.0
        #: When the data thread last got a record, and when it may next tell the machine its
        #: input is quiet (``commit.early_idle_ms``; 0: never).
        self._quiet_s = cfg.commit.early_idle_ms / 1000
        self._last_record = time.monotonic()
        self._next_quiet = 0.0
        #: When the control thread last read a PREPARE, and when a DRAINED went out or a peer's
        #: was read (monotonic seconds; plain floats: a stale read costs one longer consume).
        self._interval_s = cfg.commit.interval_ms / 1000
        self._prepare_seen = 0.0
        self._drained_sent = 0.0
        #: Where the consumer was last assigned or sought to, per partition: librdkafka's
        #: position() knows nothing (-1001) until a record is consumed after either.
        self._sought: dict[tuple[str, int], int] = {}
        #: Where each partition was last sought to, until its first record: records deleted
        #: from there before they were delivered are logged and counted (:mod:`.gaps`).
        self._unread = UnreadStarts(cfg.pipeline, self.metrics.deleted_unread)
        #: Fault injection (tests): read nothing, vote empty parts -- what the stall alarm sees.
        self._stall_reads = stalled("reads")
        self._batch_size = min(INITIAL_BATCH, cfg.participant.max_batch_records)
        self._assignment: list[TopicPartition] = []
        #: txn -> the source partitions of this participant's part of it, for log lines (the
        #: machine forgets a part when it is revoked or decided, before the line is written).
        self._part_tps: OrderedDict[int, tuple[tuple[str, int], ...]] = OrderedDict()

    # -- status --------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self.lock:
            m = self.machine
            return {
                "role": "participant",
                "participant": self.me,
                "pipeline": self.cfg.pipeline,
                "ready": m.ready,
                "generation": m.generation,
                "partitions": sorted(f"{t}[{p}]" for t, p in m.base),
                "open_txn": m.open.txn if m.open else None,
                "prepared": sorted(m.prepared),
                "in_doubt": sorted(f"{t}:{p}" for t, p in m.in_doubt),
                "last_decided": m.log.last_decided,
                "votes_sent": m.votes_sent,
                "rewinds": m.rewinds,
                "sinks": list(self.sink_by_name),
            }

    # -- entry point ---------------------------------------------------------------------------

    def run(self) -> None:
        """Recover, then consume until :meth:`stop` or a fatal error (re-raised)."""
        threads: list[threading.Thread] = []
        ended: BaseException | None = None
        try:
            # First, and inside the try: a port in use ends the process in one line (ConfigError
            # naming metrics.port) after closing the Kafka clients, which would keep it alive.
            self.health.start(self.cfg.metrics.host, self.cfg.metrics.port)
            # Fails fast (BrokerAuthError) when the broker refuses our credentials: the blocking
            # calls below would each wait out CALL_TIMEOUT_S and end in a bare _TIMED_OUT.
            if await_broker(self.admin, CALL_TIMEOUT_S, self.stop_event):
                check_control_topic(self.cfg, self.admin)
            else:
                log.warning("Kafka at %s is not answering yet", self.cfg.kafka.bootstrap_servers)
            for sink in self.sinks:
                # A store that is down at start-up is waited for (live, not ready), however
                # long: exiting would only restart the wait (a chaos run lost a participant to
                # a test server that answered nothing for a minute).
                self._wait_for_store(sink.setup, f"setup {sink.name}")
            reader = self._reader = ControlReader(self.cfg, on_skip=self._count_skip)
            for env in reader.replay():
                # A replayed message acts on nothing; what comes back is an out-of-sequence skip.
                self._run(self._feed(Received(env, replay=True)), Thread.DATA)
            self._feed(CaughtUp())
            delay_point("before_recovery")
            # Recovery runs to completion before anything new is written, however long the
            # stores take to answer (STORE_WAIT_S).
            self._abort_stale(budget_s=STORE_WAIT_S)
            self._run(
                self._feed(InDoubt(self._list_in_doubt(budget_s=STORE_WAIT_S)), Thread.CONTROL),
                Thread.CONTROL,
                inline=True,
            )
            control = threading.Thread(
                target=self._guard(self._control_loop, reader), name="control", daemon=True
            )
            applier = threading.Thread(
                target=self._guard(self._apply_loop), name="apply", daemon=True
            )
            threads = [applier, control]
            applier.start()
            control.start()
            self.subscription.start()
            log.info(
                "participant %s running for pipeline %s (%s)",
                self.me,
                self.cfg.pipeline,
                decoding(self.sinks, self.decoder),
            )
            quiet_gc()
            while not self.stop_event.is_set():
                self.health.beat()
                self._data_step()
        except BaseException as exc:
            ended = exc
            raise
        finally:
            # However the run ended, the other threads stop before what they use is closed.
            self.stop_event.set()
            for thread in threads:
                thread.join(timeout=10)
            control_running = any(t.name == "control" and t.is_alive() for t in threads)
            failed = self._close(control_running)
            if failed is not None and ended is None and self.fatal is None:
                raise failed
        if self.fatal is not None:
            raise self.fatal

    def stop(self) -> None:
        self.stop_event.set()
        self._wake.set()

    def _to_data_thread(self, action: Action) -> None:
        self.data_queue.put(action)
        self._wake.set()

    def _close(self, control_running: bool) -> Exception | None:
        """Close the clients, the sinks and the health server; the first error that is not a
        Kafka client's own, for the caller to raise when nothing else ended the run."""
        closers: list[Callable[[], object]] = []
        if self._reader is not None:
            if control_running:  # never close a consumer under another thread's poll
                log.warning("the control thread did not stop: its Kafka reader is left open")
            else:
                closers.append(self._reader.close)
        closers += [self.consumer.close, lambda: self.producer.flush(5)]
        failed = close_quietly(closers, self.sinks)
        self.health.stop()
        return failed

    def _guard(self, fn: Callable[..., None], *args: Any) -> Callable[[], None]:
        def run() -> None:
            try:
                fn(*args)
            except (TwophaseError, SinkError) as exc:
                # run() re-raises it: one line, said once, by the caller (the CLI), with the
                # exit status its class calls for -- no traceback for an error we named.
                self.fatal = exc
                self.stop_event.set()
                self._wake.set()
            except BaseException as exc:  # a dead control thread must stop the process
                log.exception("control thread failed")
                self.fatal = exc
                self.stop_event.set()
                self._wake.set()

        return run

    def _count_skip(self, kind: str) -> None:
        self.metrics.control_skipped.labels(self.cfg.pipeline, kind).inc()

    # -- the machine ---------------------------------------------------------------------------

    def _feed(self, event: Event, here: Thread = Thread.DATA) -> list[Action]:
        """Feed the machine. From the control side, actions for the data thread are queued
        *under the lock*, so the data thread's "nothing queued -> open a part" check is atomic
        with every decision the machine took."""
        if isinstance(event, Received) and isinstance(event.env.payload, COORDINATOR_MESSAGES):
            # Where the coordinator that wrote it reads replies: the latest one read decides.
            self.control.reply_to = event.env.reply_to
        with self.lock:
            self._remember_parts()
            actions = self.machine.handle(event)
            self._remember_parts()
            if here is Thread.DATA:
                return actions
            rest: list[Action] = []
            for action in actions:
                if getattr(action, "thread", here) is Thread.DATA:
                    self._to_data_thread(action)
                else:
                    rest.append(action)
            return rest

    # -- log fields ----------------------------------------------------------------------------

    def _remember_parts(self) -> None:
        """Note the partitions of our open and prepared parts (under the lock)."""
        m = self.machine
        parts = [(m.open.txn, m.open.start)] if m.open is not None and m.open.txn else []
        parts += [(txn, part.start) for txn, part in m.prepared.items()]
        for txn, start in parts:
            if txn not in self._part_tps and start:
                self._part_tps[txn] = tuple(sorted(start))
                while len(self._part_tps) > TXN_PARTITIONS_KEPT:
                    self._part_tps.popitem(last=False)

    def _txn_extra(
        self, txn: int, participant: str = "", tps: Iterable[tuple[str, int]] | None = None
    ) -> dict[str, Any]:
        """Log fields of a line about ``participant``'s part of ``txn`` (ours by default): its
        partitions when we know them, else the transaction's (its commit decision names them),
        else none."""
        if tps is None:
            with self.lock:
                mine = participant in ("", self.me)
                found = self._part_tps.get(txn) if mine else None
                if found is None:
                    decision = self.machine.log.decisions.get(txn)
                    if decision is not None and decision.positions:
                        found = tuple((p.topic, p.partition) for p in decision.positions)
                    elif mine and self.machine.open is not None and self.machine.open.txn == txn:
                        found = tuple(self.machine.base)
                tps = found or ()
        return txn_extra(txn, tps, pipeline=self.cfg.pipeline, participant=self.me)

    def _run(self, actions: list[Action], here: Thread, *, inline: bool = False) -> None:
        """Execute actions meant for this thread; queue the data thread's; hand decisions on
        prepared parts to the apply worker (in order), except our own ones when ``inline``
        (start-up recovery)."""
        for action in actions:
            target = getattr(action, "thread", here)
            if here is Thread.CONTROL and target is Thread.DATA:
                self._to_data_thread(action)
            elif (
                isinstance(action, (CommitPart, AbortPart))
                and target is Thread.CONTROL
                and not (inline and action.participant == self.me)
            ):
                # Start-up recovery applies only our own parts inline (this participant's next
                # part starts after them). Other participants' go to the apply worker, so that a
                # part whose committer died mid-commit (its MongoDB lease live for a minute)
                # does not keep this participant from joining and voting meanwhile.
                self.apply_queue.put(action)
            else:
                self._execute(action, here)

    def _apply_loop(self) -> None:
        """Applies decisions in log order, so the control thread keeps reading (and forwarding
        the next PREPARE) while a slow store commits the previous part."""
        while not self.stop_event.is_set():
            try:
                action = self.apply_queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(action, _Forget):
                self._forget(action.before)
                continue
            if isinstance(action, _AbortStale):
                self._sweep_stale()
                continue
            assert isinstance(action, (CommitPart, AbortPart))
            self._apply(action, Thread.CONTROL)

    def _execute(self, action: Action, here: Thread) -> None:
        if isinstance(action, (CommitPart, AbortPart)):
            self._apply(action, here)
        elif isinstance(action, SendVote):
            vote = action.vote
            tps = [(r.topic, r.partition) for r in vote.partitions]
            with log_context(self._txn_extra(vote.txn, tps=tps)):
                _crash_point("before_vote")
                delay_point("before_vote")
                # Kafka away (a broker restart, a partition): wait for it, as for a store the
                # process cannot go on without. Giving up ended the process, and its restart
                # only waited for the same broker, having lost its assignment; a vote sent late
                # is one the coordinator no longer counts (the cycle timed out and aborted).
                self._wait_for_store(lambda: self.control.send(vote), f"txn={vote.txn} send vote")
                _crash_point("after_vote")
        elif isinstance(action, SendDrained):
            # Advisory: a hint that does not go out only leaves the next cycle to the interval.
            # Not flushed: the producer is shared with votes and dead letters, and the data
            # thread must not wait for them.
            self.control.post(action.drained)
            self._drained_sent = time.monotonic()
        elif isinstance(action, SendApplied):
            applied = action.applied
            with log_context(self._txn_extra(applied.txn, applied.part)):
                sent = self._wait_for_store(
                    lambda: self.control.send(applied), f"txn={applied.txn} send applied"
                )
            if sent.reply_to:
                # Not read back from the control topic: fold it in here, as reading it would,
                # so a later sweep does not take the part for unacknowledged and apply it again.
                self._run(self._feed(Received(sent), here), here)
        elif isinstance(action, Sweep):
            if not self._aborting_stale.is_set():
                # On the apply worker, like forgetting: a store slow to abort (a MongoDB part
                # whose lease another thread holds was retried for ~25 s in a chaos run) must
                # not hold up the control thread, which forwards PREPAREs and sends the votes.
                self._aborting_stale.set()
                self.apply_queue.put(_AbortStale())
            try:
                # On the control thread: bounded by participant.sink_retry_s, and a store that
                # does not answer costs only this sweep (the next one lists again).
                in_doubt = self._list_in_doubt()
            except FatalSinkError:
                raise
            except (SinkError, RetriableError) as exc:
                log.warning(
                    "sweep: cannot list in-doubt parts (the next sweep tries again): %s",
                    exc,
                    extra={"pipeline": self.cfg.pipeline, "participant": self.me},
                )
            else:
                self._run(
                    self._feed(InDoubt(in_doubt, sweep=True, live=self._live_participants()), here),
                    here,
                )
            if action.forget_before and not self._forgetting.is_set():
                # On the apply worker, after the decisions queued before it: a slow delete
                # there never holds up the control thread (PREPAREs, hence votes).
                self._forgetting.set()
                self.apply_queue.put(_Forget(action.forget_before))
        elif isinstance(action, BeginPart):
            part = PartId(self.cfg.pipeline, action.txn, self.me)
            with log_context(self._txn_extra(action.txn)):
                for sink in self.sinks:
                    self._retry(partial(sink.begin, part), f"txn={action.txn} begin {sink.name}")
        elif isinstance(action, PreparePart):
            self._prepare(action)
        elif isinstance(action, Seek):
            self._seek(action.offsets)
        elif isinstance(action, Skipped):
            self._count_skip(action.kind)
            log.warning(
                "txn=%d skipping control message: %s: %s",
                action.txn,
                action.kind,
                action.message,
                extra=self._txn_extra(action.txn),
            )
        elif isinstance(action, Log):
            getattr(log, action.level)(
                "%s%s",
                f"txn={action.txn} " if action.txn else "",
                action.message,
                extra=self._txn_extra(action.txn)
                if action.txn
                else {"pipeline": self.cfg.pipeline, "participant": self.me},
            )

    def _retry(self, fn: Callable[[], T], what: str, budget_s: float | None = None) -> T:
        """A sink call retried for ``budget_s`` (default ``participant.sink_retry_s``)."""
        budget = self.cfg.participant.sink_retry_s if budget_s is None else budget_s
        return STORE.call(
            fn, what, budget_s=budget, stop=self.stop_event, give_up=RetriableError, logger=log
        )

    def _wait_for_store(self, fn: Callable[[], T], what: str) -> T:
        """A sink call (or a control message) the process cannot go on without: retried until
        it succeeds or the process is stopped (STORE_WAIT_S)."""
        return self._retry(fn, what, budget_s=STORE_WAIT_S)

    # -- decisions -----------------------------------------------------------------------------

    def _apply(self, action: CommitPart | AbortPart, here: Thread) -> None:
        with log_context(self._txn_extra(action.txn, action.participant)):
            if not self._apply_in_sinks(action):
                return
        outcome = Outcome.COMMIT if isinstance(action, CommitPart) else Outcome.ABORT
        self._run(self._feed(PartApplied(action.txn, action.participant, outcome), here), here)

    def _apply_in_sinks(self, action: CommitPart | AbortPart) -> bool:
        """Apply a decision in every sink of the part; False when it is not ours to apply."""
        commit = isinstance(action, CommitPart)
        part = PartId(self.cfg.pipeline, action.txn, action.participant)
        ctx = f"txn={action.txn} part={action.participant}"
        for name in action.sinks:
            sink = self.sink_by_name.get(name)
            if sink is None:
                log.error("%s names sink %s which this participant does not have", ctx, name)
                return False
            if commit:
                _crash_point("before_commit")
            try:
                # A decided part is applied however long the store needs: giving up would only
                # hand the same work to recovery after a restart.
                self._wait_for_store(
                    partial(sink.commit if commit else sink.abort, part), f"{ctx} {name}"
                )
            except UnknownPartError as exc:
                if action.participant == self.me:
                    raise FatalError(
                        f"{ctx}: own prepared part lost in sink {name}: {exc}"
                    ) from None
                log.warning(
                    "%s: sink %s cannot see this part (%s); leaving it to its owner", ctx, name, exc
                )
                return False
            if commit:
                _crash_point("mid_commit")
        log.info(
            "%s %s in %s",
            ctx,
            "committed" if commit else "aborted",
            ", ".join(action.sinks) or "no sink",
        )
        return True

    def _abort_stale(self, budget_s: float | None = None) -> None:
        """Parts begun and never prepared by processes that are gone can never commit: abort
        them, so their staged data does not pile up. Only transactions already decided qualify
        (a live participant's open part is always newer). ``budget_s``: per store call (start-up
        recovery waits, STORE_WAIT_S; a sweep gives up and leaves it to the next one)."""
        with self.lock:
            before = self.machine.log.last_decided + 1
        for sink in self.sinks:
            stale = self._retry(
                partial(sink.stale_parts, before), f"stale_parts {sink.name}", budget_s
            )
            for part in stale:
                if part.pipeline != self.cfg.pipeline:
                    continue
                with log_context(self._txn_extra(part.txn, part.participant)):
                    self._retry(
                        partial(sink.abort, part), f"abort stale {part.token} {sink.name}", budget_s
                    )
                    log.info(
                        "txn=%s aborted stale open part of %s in %s",
                        part.txn,
                        part.participant,
                        sink.name,
                    )

    def _sweep_stale(self) -> None:
        """A sweep's :meth:`_abort_stale`, on the apply worker: a store that keeps failing
        costs only staged data until a later sweep; a FatalSinkError stops the process."""
        try:
            self._abort_stale()
        except FatalSinkError:
            raise
        except (SinkError, RetriableError) as exc:
            log.warning(
                "could not abort stale parts (a later sweep tries again): %s",
                exc,
                extra={"pipeline": self.cfg.pipeline, "participant": self.me},
            )
        finally:
            self._aborting_stale.clear()

    def _forget(self, before: int) -> None:
        """Every sink deletes the markers of decided parts below ``before`` (the machine's
        bound, see ``ParticipantMachine.forget_before``). Housekeeping: a store that keeps
        failing (retriable errors past the budget) costs only growth until a later sweep, so
        that is logged; a FatalSinkError stops the process, as from any sink call."""
        try:
            with self.lock:
                tps = tuple(self.machine.log.positions)
            # About every transaction up to before - 1, hence every source partition.
            base = (
                txn_extra(before - 1, tps, pipeline=self.cfg.pipeline, participant=self.me)
                if tps
                else {"pipeline": self.cfg.pipeline, "participant": self.me}
            )
            for sink in self.sinks:
                fields = {**base, "sink": sink.name}
                try:
                    with log_context(fields):
                        deleted = self._retry(partial(sink.forget, before), f"forget {sink.name}")
                except FatalSinkError:
                    raise
                except (SinkError, RetriableError) as exc:
                    log.warning(
                        "sink %s could not forget markers below txn %d (a later sweep tries "
                        "again): %s",
                        sink.name,
                        before,
                        exc,
                        extra=fields,
                    )
                    continue
                if deleted:
                    self.metrics.markers_forgotten.labels(self.cfg.pipeline, sink.name).inc(deleted)
                    log.info(
                        "sink %s forgot %d markers of decided parts up to txn %d",
                        sink.name,
                        deleted,
                        before - 1,
                        extra=fields,
                    )
        finally:
            self._forgetting.clear()

    def _new_admin(self) -> AdminClient:
        return AdminClient(client_settings(self.cfg, "admin"))

    def _replace_admin(self) -> None:
        """Swap in a fresh AdminClient. The old one is dropped on a thread of its own: destroying
        a librdkafka handle with requests in flight must never hold up the control thread."""
        retired = [self.admin]
        self.admin = self._new_admin()
        threading.Thread(target=retired.clear, name="admin-retire", daemon=True).start()

    def _live_participants(self) -> frozenset[str] | None:
        """Participants that are members of the source group now (by their client.id); None
        when the group cannot be described, so no foreign part is touched this sweep.

        Waits at most DESCRIBE_TIMEOUT_S (+ grace). A describe that times out replaces the
        AdminClient: one that got stuck across a broker restart never answers again.
        """
        prefix = self._client_id_prefix
        group = self.cfg.group_id
        timed_out = False
        try:
            future = self.admin.describe_consumer_groups(
                [group], request_timeout=DESCRIBE_TIMEOUT_S
            )[group]
            desc = future.result(timeout=DESCRIBE_TIMEOUT_S + DESCRIBE_GRACE_S)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            timed_out = isinstance(err, KafkaError) and err.code() == KafkaError._TIMED_OUT
            reason = f"{err.str()} ({err.name()})" if isinstance(err, KafkaError) else str(exc)
        except TimeoutError:  # the future itself never completed
            timed_out = True
            reason = f"no answer within {DESCRIBE_TIMEOUT_S + DESCRIBE_GRACE_S:.1f}s"
        else:
            return frozenset(
                m.client_id[len(prefix) :] for m in desc.members if m.client_id.startswith(prefix)
            )
        if timed_out:
            log.warning("cannot describe group %s: %s; replacing the admin client", group, reason)
            self._replace_admin()
        else:
            log.warning("cannot describe group %s: %s", group, reason)
        return None

    def _list_in_doubt(self, budget_s: float | None = None) -> tuple[tuple[str, int, str], ...]:
        found = []
        for sink in self.sinks:
            for part in self._retry(sink.in_doubt, f"in_doubt {sink.name}", budget_s):
                if part.pipeline == self.cfg.pipeline:
                    found.append((sink.name, part.txn, part.participant))
        self.metrics.in_doubt.labels(self.cfg.pipeline).set(len(found))
        return tuple(found)

    # -- control thread ------------------------------------------------------------------------

    def _control_loop(self, reader: ControlReader) -> None:
        while not self.stop_event.is_set():
            env = reader.poll(CONTROL_POLL_S)
            if env is not None:
                if isinstance(env.payload, Prepare):
                    delay_point("on_prepare")
                self._run(self._feed(Received(env), Thread.CONTROL), Thread.CONTROL)
                # After the PREPARE is handed over (and the data thread woken): a data thread
                # that saw it no longer due before that would wait in a consume, not for it.
                if isinstance(env.payload, Prepare):
                    self._prepare_seen = time.monotonic()
                elif isinstance(env.payload, Drained):
                    self._drained_sent = time.monotonic()  # a peer's: a PREPARE may come now
            self._run(self._feed(Tick(_now_ms()), Thread.CONTROL), Thread.CONTROL)

    # -- data thread ---------------------------------------------------------------------------

    def _data_step(self) -> None:
        self._drain_queue()
        if self.fatal is not None:
            return
        if self.apply_queue.qsize() >= MAX_UNAPPLIED or self._stall_reads:
            # The stores apply slower than we read: hold consumption (the group session stays
            # alive through consume(), which we keep calling with everything paused).
            self._pause()
        elif self._paused and not self._poisoned:
            self._resume()
        self.subscription.refresh()
        if self._prepare_due():
            # Take what is there, and with nothing there wait for the control thread -- the
            # PREPARE wakes this thread at once -- not in a consume nothing can cut short.
            msgs = self.consumer.consume(self._batch_size, 0)
            if not msgs:
                self._wake.wait(CONSUME_TIMEOUT_S)
                self._wake.clear()  # before the queue is drained (next step): nothing is lost
        else:
            msgs = self.consumer.consume(self._batch_size, CONSUME_TIMEOUT_S)
        if msgs:
            delay_point("after_consume")
        if self._drain_queue():
            # A rewind happened (queued, or caused by a queued prepare that failed): what was
            # just fetched will be fetched again from the new positions.
            if msgs:
                log.info("%d records fetched before a rewind dropped: read again", len(msgs))
            return
        good = [m for m in msgs if m.error() is None]
        if self._held and good:
            # Fetched before the pause took: read again, from the held record, for the next part.
            good = [m for m in good if (m.topic(), m.partition()) not in self._held]
        self._unread.check(self.consumer, good)
        for m in msgs:
            err = m.error()
            if err is not None:
                raise_fatal(err)
        if good and not self._paused:
            started = time.monotonic()
            self._write(good)
            self._adapt_batch(len(good), time.monotonic() - started)
        if msgs:
            self._last_record = time.monotonic()
        elif self._quiet_s:
            self._check_quiet()
        if time.monotonic() >= self._next_lag:
            self._next_lag = time.monotonic() + LAG_REFRESH_S
            self._update_lag()

    def _prepare_due(self) -> bool:
        return prepare_due(
            time.monotonic(), self._prepare_seen, self._interval_s, self._drained_sent
        )

    def _check_quiet(self) -> None:
        """Tell the machine the input is drained (:class:`Quiet`) when nothing came for
        ``commit.early_idle_ms`` and every assigned partition is read up to its high watermark
        (as the last fetch saw it: no broker round trip). At most once per quiet period."""
        now = time.monotonic()
        if (
            now - self._last_record < self._quiet_s
            or now < self._next_quiet
            or self._paused
            or self._held
            or self._poisoned
            or not self._assignment
        ):
            return
        self._next_quiet = now + self._quiet_s
        positions: dict[tuple[str, int], int] = {}
        try:
            for tp in self.consumer.position(list(self._assignment)):
                marks = self.consumer.get_watermark_offsets(tp, cached=True)
                if marks is None:
                    return
                _low, high = marks
                at = tp.offset if tp.offset >= 0 else self._sought.get((tp.topic, tp.partition), -1)
                if high < 0 or at < high:
                    return  # not read to the end (or not fetched yet)
                positions[(tp.topic, tp.partition)] = at
        except KafkaException:
            return
        self._run(self._feed(Quiet(positions)), Thread.DATA)

    def _adapt_batch(self, n: int, seconds: float) -> None:
        """Size the next batch so that writing it into every sink takes about BATCH_TARGET_S:
        a PREPARE waits for at most one batch, whatever the stores' speed."""
        if n < self._batch_size // 2 or seconds <= 0:
            return  # a short batch says nothing about the stores' speed
        rate = n / seconds
        want = int(rate * BATCH_TARGET_S)
        self._batch_size = max(MIN_BATCH, min(self.cfg.participant.max_batch_records, want))

    def _drain_queue(self) -> bool:
        """Run what the control thread queued for this thread; whether the consumer was sought
        meanwhile -- by a queued rewind, or by one a queued action caused (a prepare that fails
        rewinds to the committed positions): then records in hand are stale."""
        seeks = self._seeks
        while True:
            try:
                action = self.data_queue.get_nowait()
            except queue.Empty:
                return self._seeks != seeks
            if isinstance(action, PreparePart) and not action.ready:
                self._run(self._feed(Cut(action.txn)), Thread.DATA)
            else:
                self._execute(action, Thread.DATA)

    def _prepare(self, action: PreparePart) -> None:
        part = PartId(self.cfg.pipeline, action.txn, self.me)
        started = time.monotonic()
        if self._failed_txn == action.txn:
            reason = "a write of this part failed: it is aborted and re-read"
            log.warning(
                "txn=%s prepare refused: %s",
                action.txn,
                reason,
                extra=self._txn_extra(action.txn, tps=action.positions),
            )
            self._run(self._feed(PrepareFailed(action.txn, reason)), Thread.DATA)
            self._release_held()
            return
        try:
            with log_context(self._txn_extra(action.txn, tps=action.positions)):
                self.dlq.flush(CALL_TIMEOUT_S)
                for name in action.sinks:
                    sink = self.sink_by_name[name]
                    self._retry(
                        partial(sink.prepare, part, action.positions),
                        f"prepare {name}",
                    )
        except FatalSinkError:
            raise
        except (SinkError, RetriableError) as exc:
            log.warning(
                "txn=%s prepare failed: %s",
                action.txn,
                exc,
                extra=self._txn_extra(action.txn, tps=action.positions),
            )
            self._run(self._feed(PrepareFailed(action.txn, str(exc))), Thread.DATA)
            self._release_held()
            return
        self.metrics.cycle_seconds.labels(self.cfg.pipeline, "prepare").observe(
            time.monotonic() - started
        )
        _crash_point("after_prepare")
        self._run(self._feed(PrepareDone(action.txn)), Thread.DATA)
        self._release_held()

    def _write(self, msgs: list[Message]) -> None:
        # Open the part only when nothing is queued for this thread, checked under the lock the
        # control thread queues under: a rewind can never land between the machine opening a
        # part and the sinks beginning it (same id: the abort would hit the new part). Queued
        # work (a prepare, say) runs outside the lock so decisions are never held up by it.
        while True:
            if self._drain_queue():
                # Rewound: these records will be fetched again from the new positions.
                log.info("%d records fetched before a rewind dropped: read again", len(msgs))
                return
            with self.lock:
                if self.data_queue.empty():
                    actions = self.machine.handle(WillWrite())
                    # The part's number, read under the same lock: once it is released the
                    # control thread may abandon this part (a decision, a rebalance), and the
                    # batch must still go to the part the sinks began -- its abort is queued
                    # for this thread, behind the write.
                    open_part = self.machine.open
                    assert open_part is not None, "WillWrite always leaves a part open"
                    part_txn = open_part.txn
                    break
        try:
            self._run(actions, Thread.DATA)
        except FatalSinkError:
            raise
        except (SinkError, RetriableError) as exc:
            log.error("could not open a part, it will be aborted and re-read: %s", exc)
            # Its prepare must fail here: the sinks that never began it would be asked to
            # prepare a part they do not know.
            self._failed_txn = part_txn
            self._poisoned = True
            self._pause()
            return
        part = PartId(self.cfg.pipeline, part_txn, self.me)
        fields = self._txn_extra(part_txn)
        try:
            with log_context(fields):
                batch = write_batch(
                    msgs,
                    part,
                    self.sinks,
                    dlq=self.dlq,
                    metrics=self.metrics,
                    decoder=self.decoder,
                    max_record_bytes=self.cfg.participant.max_record_bytes,
                    retry=self._retry,
                    retractions=self.retractions,
                )
        except FatalSinkError:
            raise
        except (SinkError, RetriableError) as exc:
            # The open part is lost; stop reading until the next PREPARE fails it and rewinds.
            log.error(
                "txn=%s write failed, the part will be aborted and re-read: %s",
                part_txn,
                exc,
                extra=fields,
            )
            self._failed_txn = part_txn
            self._poisoned = True
            self._pause()
            return
        self._run(self._feed(Written(part_txn, batch.result)), Thread.DATA)
        if batch.held:
            self._hold(batch.held)

    # -- consumer positions --------------------------------------------------------------------

    def _pause(self) -> None:
        if not self._paused and self._assignment:
            self.consumer.pause(self._assignment)
        self._paused = True

    def _resume(self) -> None:
        if self._paused and self._assignment:
            self.consumer.resume(
                [tp for tp in self._assignment if (tp.topic, tp.partition) not in self._held]
            )
        self._paused = False

    def _hold(self, held: dict[tuple[str, int], int]) -> None:
        """The open part ends at these offsets: read each partition again from there, once the
        part is cut (:meth:`_release_held`)."""
        for (topic, partition), offset in held.items():
            tp = TopicPartition(topic, partition, offset)
            self.consumer.pause([tp])
            self.consumer.seek(tp)
            self._sought[(topic, partition)] = offset
            self._unread.expect(self.consumer, {(topic, partition): offset})
            self._held[(topic, partition)] = offset

    def _release_held(self) -> None:
        """The part is cut (prepared, or failed and rewound): held partitions feed the next."""
        if not self._held:
            return
        held = [TopicPartition(t, p) for t, p in self._held]
        self._held.clear()
        if not self._paused:
            self.consumer.resume(held)

    def _seek(self, offsets: dict[tuple[str, int], int] | Any) -> None:
        self._seeks += 1
        owned = {(tp.topic, tp.partition) for tp in self._assignment}
        targets = [
            TopicPartition(t, p, o) for (t, p), o in sorted(offsets.items()) if (t, p) in owned
        ]
        self._poisoned = False
        self._failed_txn = None
        # Every partition goes back to the part's start: a held one too, and it is paused on
        # its own -- released here, or nothing would ever resume it (a part aborted while a
        # sink held a record stalled its partitions for good).
        self._release_held()
        self._resume()
        self._sought.update(((t.topic, t.partition), t.offset) for t in targets)
        self._unread.expect(self.consumer, {(t.topic, t.partition): t.offset for t in targets})
        for tp in targets:
            try:
                self.consumer.seek(tp)
            except KafkaException:
                # Not fetching yet (just assigned): re-assigning sets the start offsets instead.
                self.consumer.assign(
                    [TopicPartition(t.topic, t.partition, t.offset) for t in targets]
                )
                break

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        generation, member = group_generation(consumer)
        # Raised out of consume() these would end the process: retry what a broker restart
        # causes (NOT_COORDINATOR while the group coordinator moves, time-outs).
        committed = (
            KAFKA.call(
                lambda: consumer.committed(partitions, timeout=CALL_TIMEOUT_S),
                "reading the source group's offsets",
                stop=self.stop_event,
            )
            if partitions
            else []
        )
        offsets: dict[tuple[str, int], int] = {}
        for c in committed:
            off = c.offset
            if off < 0:
                off, _high = KAFKA.call(
                    partial(consumer.get_watermark_offsets, c, timeout=CALL_TIMEOUT_S),
                    f"reading the start of {c.topic}[{c.partition}]",
                    stop=self.stop_event,
                )
            offsets[(c.topic, c.partition)] = off
        actions = self._feed(Assigned(generation, member, offsets, self.subscription.topics))
        start = offsets
        for a in actions:
            if isinstance(a, Seek):
                start = dict(a.offsets)
        self._assignment = [TopicPartition(t, p, start[(t, p)]) for t, p in sorted(start)]
        self._sought = dict(start)
        self._unread.clear()
        self._unread.assigned(start)
        self._unread.expect(self.consumer, start)
        consumer.assign(self._assignment)
        if self._assignment:
            # librdkafka keeps a partition's pause flag across unassign/assign: one paused before
            # the rebalance would otherwise never be fetched again while _paused says False.
            consumer.resume(self._assignment)
        # The open part went with the rebalance: a failed write of it no longer fails the
        # next part, which may be begun under the same transaction number.
        self._paused = self._poisoned = False
        self._failed_txn = None
        self._held.clear()
        self._run([a for a in actions if not isinstance(a, Seek)], Thread.DATA)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._run(self._feed(Revoked()), Thread.DATA)
        self._assignment = []
        self._paused = self._poisoned = False
        self._failed_txn = None
        self._held.clear()
        consumer.unassign()

    def _update_lag(self) -> None:
        self.admin.poll(0)  # serves the admin client's error and log callbacks
        for tp in self._assignment:
            try:
                _low, high = self.consumer.get_watermark_offsets(tp, cached=True)
                pos = self.consumer.position([TopicPartition(tp.topic, tp.partition)])[0].offset
            except KafkaException:
                continue
            if high >= 0 and pos >= 0:
                self.metrics.lag.labels(self.cfg.pipeline, tp.topic, str(tp.partition)).set(
                    high - pos
                )
