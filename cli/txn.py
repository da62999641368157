"""Operator views of transactions: what ``twophase txn list|show|resolve`` read and do.

Two sources, read directly (no running process is asked, so this works when they are down):

* the **decision log**: the control topic's tail from the latest CHECKPOINT, folded into a
  :class:`~twophase.protocol.logview.LogView` exactly as a recovering participant folds it, so
  the outcome shown for a part is the outcome recovery will apply;
* every **sink** of the pipeline, built from the config and asked :meth:`Sink.in_doubt`.

``resolve`` applies an outcome to one part in the sinks, and only when it agrees with the log:
an operator can finish what the log already decided (or presumes), never decide it differently.
The one exception, ``force`` for an abort of a part the log has not decided, is the operator's
own call and is reported as such.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from twophase.config import PipelineConfig
from twophase.errors import ConfigError, FatalError, RetriableError, TwophaseError
from twophase.kafka import (
    CALL_TIMEOUT_S,
    ControlReader,
    client_settings,
    read_control,
    reply_reader,
)
from twophase.participants.registry import build_sinks
from twophase.participants.sdk import (
    BatchingSink,
    PartId,
    Sink,
    SinkError,
)
from twophase.protocol.logview import LogView
from twophase.protocol.messages import (
    REPLIES,
    Applied,
    Checkpoint,
    Complete,
    Decision,
    Envelope,
    Outcome,
    Prepare,
    Vote,
)
from twophase.retry import CLI_RESOLVE_RETRY_S, CLI_SETUP_RETRY_S, STORE

__all__ = [
    "CLI_PARTICIPANT",
    "LogFold",
    "Progress",
    "ResolveCheck",
    "ResolveRefused",
    "check_resolve",
    "explain_outcome",
    "fold_log",
    "list_txns",
    "live_participants",
    "open_sinks",
    "resolve_part",
    "show_txn",
]

log = logging.getLogger("twophase.cli.txn")

#: Notes of what is happening, for a spinner (``twophase txn`` shows them on stderr).
Progress = Callable[[str], None]

#: The participant id the CLI's sink instances run under. Never a real participant's: sinks use
#: it only to name themselves (e.g. the MongoDB sink's commit lease holder).
CLI_PARTICIPANT = "twophase-cli"
#: A control-topic read that gets neither a message nor the partition's end for this long has
#: failed (broker down, no leader): long enough for a broker restart, like every Kafka call here.
READ_STALL_S = CALL_TIMEOUT_S

T = TypeVar("T")


def _quiet(_note: str) -> None:
    pass


# -- the decision log ------------------------------------------------------------------------


@dataclass
class LogFold:
    """The control log's tail, folded: the view recovery uses plus what operators want to see."""

    view: LogView
    read_from: str
    messages: int = 0
    #: txn -> (ts_ms, deadline_ms) of its PREPARE, for the transactions prepared in the tail.
    prepared: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: txn -> ts_ms of its DECISION.
    decided_at: dict[int, int] = field(default_factory=dict)
    last_commit: Decision | None = None
    last_commit_ts: int = 0
    #: Sender of the latest coordinator message (``coordinator:<instance>``).
    last_coordinator: str | None = None
    #: ts_ms of the first message folded: a position not moved since is unmoved at least since.
    first_ts: int = 0
    #: (topic, partition) -> ts_ms of the last commit in the tail that moved its position.
    moved_at: dict[tuple[str, int], int] = field(default_factory=dict)
    #: Every message about the transaction asked for (``fold_log(txn=...)``): the control
    #: topic's in log order, then the reply topic's.
    of_txn: list[Envelope] = field(default_factory=list)


def _txn_of(env: Envelope) -> int | None:
    msg = env.payload
    if isinstance(msg, Prepare | Vote | Decision | Applied | Complete):
        return msg.txn
    return None


def _require_topic(cfg: PipelineConfig) -> bool:
    """Raise unless the control topic exists; whether the reply topic does."""
    admin = AdminClient(client_settings(cfg, "admin"))
    try:
        # All topics, not the one: a metadata request naming a topic can auto-create it.
        topics = admin.list_topics(timeout=CALL_TIMEOUT_S).topics
    except KafkaException as exc:
        raise RetriableError(f"Kafka metadata unavailable: {exc.args[0].str()}") from None
    if cfg.control_topic not in topics:
        raise FatalError(
            f"control topic {cfg.control_topic} does not exist "
            "(run `twophase topics create CONFIG` first)"
        )
    return cfg.reply_topic in topics


def fold_log(
    cfg: PipelineConfig,
    *,
    txn: int | None = None,
    from_beginning: bool = False,
    progress: Progress = _quiet,
) -> LogFold:
    """Fold the control log from the latest checkpoint (or the first retained message) to its
    current end, then the reply topic's votes and APPLIED the checkpoint does not reflect (as a
    new leader does). With ``txn``, also keep every message about that transaction."""
    reply_topic_there = _require_topic(cfg)
    skipped: list[str] = []
    replies_from = -1
    reader = ControlReader(cfg, on_skip=skipped.append)
    fold = LogFold(LogView(), "beginning" if from_beginning else "checkpoint")
    try:
        if from_beginning:
            reader.consumer.assign([TopicPartition(cfg.control_topic, 0, OFFSET_BEGINNING)])
        progress("reading the control log")
        # Stop at the end as of now, not at an end-of-partition event: on a busy pipeline every
        # fetch returns new messages, so that event never comes and the read would chase the
        # live tail forever. (read_committed: the high mark is the last stable offset.)
        _low, end = reader.consumer.get_watermark_offsets(reader.tp, timeout=CALL_TIMEOUT_S)
        last_progress = time.monotonic()
        while not reader.at_end:
            if reader.consumer.position([reader.tp])[0].offset >= end:
                break
            env = reader.poll(0.5)
            if env is None:
                if time.monotonic() - last_progress > READ_STALL_S:
                    raise RetriableError(
                        f"control topic {cfg.control_topic}: no message and no end of the "
                        f"partition within {READ_STALL_S:.0f}s (is Kafka up?)"
                    )
                continue
            last_progress = time.monotonic()
            if fold.view.out_of_sequence(env.payload):
                skipped.append("out_of_sequence")  # a decision nothing led to: not folded
                continue
            if isinstance(env.payload, Checkpoint) and not from_beginning:
                # The log's order is the checkpoints' order: the last one read is the newest.
                here = env.reply_to == cfg.reply_topic
                replies_from = env.payload.replies_from if here else -1
            _fold_one(fold, env, txn)
            if fold.messages % 500 == 0:
                progress(f"reading the control log: {fold.messages} messages")
    finally:
        reader.close()
    if reply_topic_there:
        _fold_replies(cfg, fold, txn, replies_from, skipped, progress)
    if skipped:
        log.warning("skipped %d unreadable control messages (%s)", len(skipped), sorted(skipped))
    return fold


def _fold_replies(
    cfg: PipelineConfig,
    fold: LogFold,
    txn: int | None,
    start: int,
    skipped: list[str],
    progress: Progress,
) -> None:
    """Fold the reply topic's VOTE and APPLIED from ``start`` (-1: the first retained) to its
    end as of now, after the control log: an APPLIED follows its DECISION."""
    consumer = reply_reader(cfg, **{"enable.partition.eof": True})
    tp = TopicPartition(cfg.reply_topic, 0)
    try:
        low, end = consumer.get_watermark_offsets(tp, timeout=CALL_TIMEOUT_S)
        # Past the end: the topic was made again since the checkpoint; read all of it.
        offset = low if start > end else max(low, start)
        if offset >= end:
            return
        consumer.assign([TopicPartition(cfg.reply_topic, 0, offset)])
        progress("reading the reply topic")
        last_progress = time.monotonic()
        while offset < end:
            msg = consumer.poll(0.5)
            if msg is None:
                if time.monotonic() - last_progress > READ_STALL_S:
                    raise RetriableError(
                        f"reply topic {cfg.reply_topic}: no message within {READ_STALL_S:.0f}s "
                        f"before its end (is Kafka up?)"
                    )
                continue
            err = msg.error()
            if err is not None and err.code() == KafkaError._PARTITION_EOF:
                return  # the end, as of now
            if err is not None:
                raise RetriableError(f"reply topic {cfg.reply_topic}: {err.str()}")
            last_progress = time.monotonic()
            offset = (msg.offset() or 0) + 1
            env = read_control(cfg, msg, skipped.append)
            if env is None:
                continue
            if not isinstance(env.payload, REPLIES):
                skipped.append("misplaced")
                continue
            _fold_one(fold, env, txn)
    except KafkaException as exc:
        raise RetriableError(f"reply topic {cfg.reply_topic}: {exc.args[0].str()}") from None
    finally:
        consumer.close()


def _fold_one(fold: LogFold, env: Envelope, txn: int | None) -> None:
    fold.messages += 1
    fold.first_ts = fold.first_ts or env.ts_ms
    msg = env.payload
    if isinstance(msg, Decision) and msg.outcome is Outcome.COMMIT:
        before = fold.view.positions
        for pos in msg.positions:
            tp = (pos.topic, pos.partition)
            if before.get(tp) != pos.offset:
                fold.moved_at[tp] = env.ts_ms
    fold.view.apply(env)
    if env.sender.startswith("coordinator:"):
        fold.last_coordinator = env.sender
    if isinstance(msg, Prepare):
        fold.prepared.setdefault(msg.txn, (env.ts_ms, msg.deadline_ms))
    elif isinstance(msg, Decision):
        fold.decided_at.setdefault(msg.txn, env.ts_ms)
        if msg.outcome is Outcome.COMMIT:
            fold.last_commit, fold.last_commit_ts = msg, env.ts_ms
    if txn is not None and (
        _txn_of(env) == txn
        or (isinstance(msg, Checkpoint) and any(p.txn == txn for p in msg.pending))
    ):
        fold.of_txn.append(env)


def explain_outcome(view: LogView, txn: int, participant: str) -> tuple[Outcome | None, str]:
    """``LogView.outcome_of`` (the authority) and, for the operator, why."""
    outcome = view.outcome_of(txn, participant)
    decision = view.decisions.get(txn)
    if decision is not None:
        if outcome is Outcome.COMMIT:
            return outcome, f"DECISION commit naming {participant}"
        if decision.outcome is Outcome.COMMIT:
            return outcome, f"DECISION commit does not name {participant}"
        reason = f": {decision.reason}" if decision.reason else ""
        return outcome, f"DECISION abort{reason}"
    if outcome is Outcome.COMMIT:
        return outcome, "committed (in the latest CHECKPOINT's pending commits)"
    if outcome is Outcome.ABORT:
        return outcome, (
            f"presumed abort: txn {txn} <= last decided {view.last_decided} "
            f"and no commit decision names {participant}"
        )
    if txn in view.undecided:
        return None, f"in flight: PREPARE {txn} seen, no decision yet"
    return None, f"not decided: txn {txn} is past the last decided {view.last_decided}"


def _outcome_name(outcome: Outcome | None) -> str:
    return outcome.value if outcome is not None else "none-yet"


# -- sinks -------------------------------------------------------------------------------------


def open_sinks(
    cfg: PipelineConfig, *, retry_s: float = CLI_SETUP_RETRY_S, progress: Progress = _quiet
) -> tuple[list[Sink], dict[str, str]]:
    """Every sink of the config, set up; plus ``{sink: error}`` for those that could not be
    (after retrying retriable errors for ``retry_s``).

    A bad sink section is the config's fault and raises :class:`ConfigError` naming the field.
    """
    built = build_sinks(
        cfg.sinks, pipeline=cfg.pipeline, participant=CLI_PARTICIPANT, source=cfg.source_file
    )
    ready: list[Sink] = []
    errors: dict[str, str] = {}
    for sink in built:
        progress(f"connecting to sink {sink.name}")
        try:
            STORE.call(sink.setup, f"setup {sink.name}", budget_s=retry_s)
        except SinkError as exc:
            errors[sink.name] = str(exc)
            _close(sink)
        else:
            ready.append(sink)
    return ready, errors


def _close(sink: Sink) -> None:
    try:
        sink.close()
    except SinkError as exc:
        log.warning("closing sink %s: %s", sink.name, exc)


@contextmanager
def _sinks(cfg: PipelineConfig, progress: Progress) -> Iterator[tuple[list[Sink], dict[str, str]]]:
    sinks, errors = open_sinks(cfg, progress=progress)
    try:
        yield sinks, errors
    finally:
        for sink in sinks:
            _close(sink)


def _in_doubt(
    sinks: list[Sink], errors: dict[str, str], progress: Progress
) -> dict[tuple[int, str], list[str]]:
    """(txn, participant) -> the sinks where that part is prepared and undecided."""
    found: dict[tuple[int, str], list[str]] = {}
    for sink in sinks:
        progress(f"listing in-doubt parts of sink {sink.name}")
        try:
            parts = STORE.call(sink.in_doubt, f"in_doubt {sink.name}", budget_s=CALL_TIMEOUT_S)
        except SinkError as exc:
            errors[sink.name] = str(exc)
            continue
        for part in parts:
            found.setdefault((part.txn, part.participant), []).append(sink.name)
    return found


def live_participants(cfg: PipelineConfig) -> frozenset[str] | None:
    """Ids of the participants that are members of the source group now; None if unknown.

    Members are told apart by their consumer's client.id, ``twophase-<pipeline>-participant-<id>``.
    """
    prefix = f"twophase-{cfg.pipeline}-participant-"
    admin = AdminClient(client_settings(cfg, "admin"))
    try:
        desc = admin.describe_consumer_groups([cfg.group_id])[cfg.group_id].result(
            timeout=CALL_TIMEOUT_S
        )
    except KafkaException:
        return None
    return frozenset(
        m.client_id[len(prefix) :] for m in desc.members if m.client_id.startswith(prefix)
    )


def _age_s(ts_ms: int | None, now: float) -> float | None:
    return round(now - ts_ms / 1000, 1) if ts_ms else None


# -- txn list ----------------------------------------------------------------------------------


def list_txns(cfg: PipelineConfig, *, progress: Progress = _quiet) -> dict[str, Any]:
    """Every part that is in doubt somewhere: prepared and undecided in a sink, or committed in
    the log and not acknowledged yet."""
    fold = fold_log(cfg, progress=progress)
    view = fold.view
    with _sinks(cfg, progress) as (sinks, errors):
        found = _in_doubt(sinks, errors, progress)
    unacked: set[tuple[int, str]] = set()
    for txn, pending in view.pending.items():
        for name in pending.parts:
            if name not in pending.acked:
                unacked.add((txn, name))
                found.setdefault((txn, name), [])
    progress("describing the source group")
    live = live_participants(cfg)
    now = time.time()
    rows: list[dict[str, Any]] = []
    for (txn, participant), prepared_in in sorted(found.items()):
        outcome, basis = explain_outcome(view, txn, participant)
        owner = "unknown" if live is None else "live" if participant in live else "gone"
        prepared = fold.prepared.get(txn)
        rows.append(
            {
                "txn": txn,
                "participant": participant,
                "prepared_in": sorted(prepared_in),
                "outcome": _outcome_name(outcome),
                "basis": basis,
                "acknowledged": (txn, participant) not in unacked
                if outcome is Outcome.COMMIT
                else None,
                "age_s": _age_s(prepared[0] if prepared else None, now),
                "owner": owner,
                "next": _next_step(outcome, owner, bool(prepared_in)),
            }
        )
    return {
        "pipeline": cfg.pipeline,
        "last_txn": view.last_txn,
        "last_decided": view.last_decided,
        "undecided": sorted(view.undecided),
        "parts": rows,
        "sink_errors": errors,
    }


def _next_step(outcome: Outcome | None, owner: str, prepared: bool) -> str:
    if outcome is None:
        return "waits for the coordinator's decision"
    if not prepared:
        return "prepared in no sink (applied); a participant's sweep acknowledges it"
    if owner == "live":
        return "its owner applies it"
    return f"the next participant sweep applies it (or: txn resolve --{outcome.value})"


# -- txn show ----------------------------------------------------------------------------------


def _sink_state(sink: Sink, part: PartId, prepared: bool) -> str:
    if prepared:
        return "prepared"
    if isinstance(sink, BatchingSink):
        marker = STORE.call(
            partial(sink.load_marker, part), f"marker of {part.token}", budget_s=CALL_TIMEOUT_S
        )
        return marker.state if marker is not None else "unknown"
    # The SDK's Sink answers only "prepared or not"; committed, aborted and never-seen look alike.
    return "not prepared"


def show_txn(
    cfg: PipelineConfig,
    txn: int,
    *,
    from_beginning: bool = False,
    progress: Progress = _quiet,
) -> dict[str, Any]:
    """The decision log's view of one transaction, and its parts' state in every sink."""
    fold = fold_log(cfg, txn=txn, from_beginning=from_beginning, progress=progress)
    view = fold.view
    prepare: dict[str, Any] | None = None
    votes: list[dict[str, Any]] = []
    decision: dict[str, Any] | None = None
    applied: list[dict[str, Any]] = []
    complete: dict[str, Any] | None = None
    participants: set[str] = set()
    for env in fold.of_txn:
        msg = env.payload
        seen = {"ts_ms": env.ts_ms, "sender": env.sender}
        if isinstance(msg, Prepare) and prepare is None:
            prepare = {**seen, "deadline_ms": msg.deadline_ms}
        elif isinstance(msg, Vote):
            participants.add(msg.participant)
            votes.append(
                {
                    **seen,
                    "participant": msg.participant,
                    "vote": msg.vote.value,
                    "generation": msg.generation,
                    "sinks": list(msg.sinks),
                    "partitions": [p.to_json() for p in msg.partitions],
                    "reason": msg.reason,
                }
            )
        elif isinstance(msg, Decision) and decision is None:
            participants.update(p.participant for p in msg.parts)
            decision = {**seen, **msg.to_json()}
        elif isinstance(msg, Applied):
            applied.append({**seen, "part": msg.part, "applied_by": msg.applied_by})
        elif isinstance(msg, Complete) and complete is None:
            complete = seen
    pending = view.pending.get(txn)
    if pending is not None:
        participants.update(pending.parts)
    with _sinks(cfg, progress) as (sinks, errors):
        found = _in_doubt(sinks, errors, progress)
        participants.update(p for t, p in found if t == txn)
        parts: list[dict[str, Any]] = []
        for participant in sorted(participants):
            outcome, basis = explain_outcome(view, txn, participant)
            states: dict[str, str] = {}
            part = PartId(cfg.pipeline, txn, participant)
            prepared_in = found.get((txn, participant), [])
            for sink in sinks:
                try:
                    states[sink.name] = _sink_state(sink, part, sink.name in prepared_in)
                except SinkError as exc:
                    states[sink.name] = f"error: {exc}"
            for name, error in errors.items():
                states.setdefault(name, f"error: {error}")
            parts.append(
                {
                    "participant": participant,
                    "outcome": _outcome_name(outcome),
                    "basis": basis,
                    "sinks": states,
                }
            )
    return {
        "pipeline": cfg.pipeline,
        "txn": txn,
        "read_from": fold.read_from,
        "last_txn": view.last_txn,
        "last_decided": view.last_decided,
        "state": _txn_state(view, txn, decision is not None, complete is not None),
        "log": {
            "prepare": prepare,
            "votes": votes,
            "decision": decision,
            "applied": applied,
            "complete": complete,
            "pending": (
                {"parts": sorted(pending.parts), "acked": sorted(pending.acked)}
                if pending is not None
                else None
            ),
        },
        "outcome": _txn_outcome(view, txn),
        "parts": parts,
        "sink_errors": errors,
    }


def _txn_outcome(view: LogView, txn: int) -> str:
    """The transaction's outcome as the log tail knows it (each part's is in ``parts``)."""
    decision = view.decisions.get(txn)
    if decision is not None:
        return decision.outcome.value
    if txn in view.pending:
        return Outcome.COMMIT.value
    if txn in view.undecided or txn > view.last_decided:
        return "none-yet"
    return "unknown"


def _txn_state(view: LogView, txn: int, decided: bool, complete: bool) -> str:
    if complete:
        return "complete"
    if txn in view.pending:
        return "committed, waiting for acknowledgements"
    if decided:
        return "decided"
    if txn in view.undecided:
        return "in flight"
    if txn <= view.last_decided:
        return "decided before the log tail read (presumed abort unless committed and complete)"
    return "not in the log"


# -- txn resolve -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolveCheck:
    """Whether an operator's outcome for a part agrees with the decision log."""

    allowed: bool
    logged: Outcome | None
    basis: str
    message: str
    forced: bool = False


class ResolveRefused(TwophaseError):
    """The operator asked for an outcome the decision log does not allow."""

    def __init__(self, check: ResolveCheck) -> None:
        super().__init__(check.message)
        self.check = check


def check_resolve(
    view: LogView, txn: int, participant: str, want: Outcome, *, force: bool = False
) -> ResolveCheck:
    """Pure: may ``want`` be applied to ``participant``'s part of ``txn``, given the log?

    * the log's outcome is never contradicted, with or without ``force``;
    * commit needs a logged commit that names the part -- only the coordinator decides commits;
    * abort of an undecided part only with ``force``: the coordinator may still decide commit.
    """
    logged, basis = explain_outcome(view, txn, participant)
    part = f"part {participant} of txn {txn}"
    if logged is want:
        return ResolveCheck(True, logged, basis, f"{part}: {want.value} agrees with the log")
    if logged is not None:
        return ResolveCheck(
            False,
            logged,
            basis,
            f"refused: the decision log says {logged.value} for {part} ({basis}); "
            f"--{want.value} would contradict it",
        )
    if want is Outcome.COMMIT:
        return ResolveCheck(
            False,
            None,
            basis,
            f"refused: no commit decision names {part} ({basis}); only the coordinator decides "
            "commits -- wait for its decision",
        )
    risk = (
        f"txn {txn} is not decided (last decided: {view.last_decided}). If the coordinator still "
        f"decides commit, {participant}'s part is gone from the sinks you abort it in: the commit "
        "cannot be applied there (the participant stops with UnknownPartError) and the records of "
        "this part are missing from them while other sinks have them. Force only once the "
        "coordinator for this pipeline is stopped for good or the transaction is known aborted."
    )
    if not force:
        return ResolveCheck(False, None, basis, f"refused: {risk} Add --force to abort anyway.")
    return ResolveCheck(True, None, basis, f"forced abort of {part}: {risk}", forced=True)


def resolve_part(
    cfg: PipelineConfig,
    txn: int,
    participant: str,
    want: Outcome,
    *,
    force: bool = False,
    retry_s: float = CLI_RESOLVE_RETRY_S,
    progress: Progress = _quiet,
) -> dict[str, Any]:
    """Apply ``want`` to one part in every sink it is prepared in (commit: also every sink the
    decision names for it). Raises :class:`ResolveRefused` when the log does not allow it."""
    try:
        part = PartId(cfg.pipeline, txn, participant)
    except ValueError as exc:
        raise ConfigError("participant", str(exc)) from None
    fold = fold_log(cfg, progress=progress)
    check = check_resolve(fold.view, txn, participant, want, force=force)
    if not check.allowed:
        raise ResolveRefused(check)
    if check.forced:
        # The full risk goes to the operator in the result; the log keeps that it was forced.
        log.info("txn=%s part=%s: operator forced abort of an undecided part", txn, participant)
    declared = (fold.view.declared_sinks(txn, participant) or ()) if want is Outcome.COMMIT else ()
    results: dict[str, str] = {}
    ok = True
    with _sinks(cfg, progress) as (sinks, errors):
        found = _in_doubt(sinks, errors, progress)
        prepared_in = set(found.get((txn, participant), []))
        for sink in sinks:
            involved = sink.name in prepared_in or sink.name in declared
            if not involved:
                results[sink.name] = "not prepared here"
                continue
            progress(f"{want.value} of {part.token} in sink {sink.name}")
            apply = sink.commit if want is Outcome.COMMIT else sink.abort
            try:
                STORE.call(partial(apply, part), f"{want.value} {part.token}", budget_s=retry_s)
            except SinkError as exc:
                results[sink.name] = f"error: {exc}"
                ok = False
                continue
            if sink.name not in prepared_in:
                # Named by the decision, not prepared: the commit found it already committed.
                results[sink.name] = "already committed"
            else:
                results[sink.name] = "committed" if want is Outcome.COMMIT else "aborted"
        for name, error in errors.items():
            results[name] = f"error: {error}"
            ok = False
    configured = {str(s["name"]) for s in cfg.sinks}
    missing = sorted(set(declared) - configured)
    if missing:
        ok = False
        for name in missing:
            results[name] = "error: the decision names this sink; it is not in this config"
    return {
        "pipeline": cfg.pipeline,
        "txn": txn,
        "participant": participant,
        "outcome": want.value,
        "basis": check.basis,
        "forced": check.forced,
        "warning": check.message if check.forced else None,
        "sinks": results,
        "ok": ok,
        "note": (
            "a participant's next sweep acknowledges the part (APPLIED) to the coordinator"
            if want is Outcome.COMMIT
            else None
        ),
    }
