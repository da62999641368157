"""The ``twophase`` command line."""

from __future__ import annotations

import faulthandler
import gc
import io
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from contextlib import suppress
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, TypeVar

import click
from confluent_kafka import KafkaError, KafkaException

from twophase.config import PipelineConfig, load_config
from twophase.errors import ConfigError, FatalError, RetriableError, TwophaseError
from twophase.participants.registry import check_config
from twophase.participants.sdk import SinkError
from twophase.retry import CLI_RESOLVE_RETRY_S

log = logging.getLogger("twophase.cli.main")
#: The option of every command that calls sinks: how long their retriable errors are retried
#: (by default the protocol's sink retry budget, twophase/retry.py).
_retry_for_option = click.option(
    "--retry-for",
    type=click.FloatRange(min=0),
    default=CLI_RESOLVE_RETRY_S,
    show_default=True,
    help="Seconds to keep retrying a sink's retriable errors.",
)
_R = TypeVar("_R")


def _load(path: str) -> PipelineConfig:
    """The config, validated the one way every command validates it: the pipeline model and
    every sink section with its sink's own model (a sink type ``validate`` rejects is rejected
    by ``coordinator run`` too). Connects to nothing."""
    try:
        return check_config(load_config(path))
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def _load_to_run(path: str) -> PipelineConfig:
    """:func:`_load` for a long-running process: a bad config is one line and EXIT_FATAL."""
    try:
        return check_config(load_config(path))
    except ConfigError as exc:
        log.error("fatal: %s", exc)
        sys.exit(EXIT_FATAL)


def _operator_logs() -> None:
    """Operator commands print results; their logs say only what went wrong, unless asked."""
    if "TWOPHASE_LOG_LEVEL" not in os.environ:
        logging.getLogger().setLevel(logging.WARNING)
        # librdkafka's own lines repeat what its error callback reports (as a warning, or as
        # the command's error): one line per problem is enough for a person at a terminal.
        logging.getLogger("twophase.librdkafka").setLevel(logging.CRITICAL)


#: Exit status of a command that refused to act (``txn resolve`` against the decision log).
EXIT_REFUSED = 3


#: Exit status of a process that stopped on an error it could not recover from (a
#: configuration, authentication or store-settings problem: retrying cannot help).
EXIT_FATAL = 2
#: Exit status of a process that stopped on anything else (a bug, or an error with no rule).
EXIT_FAILED = 1


def _warn_unauthenticated(cfg: PipelineConfig) -> None:
    if cfg.hmac_key is None:
        log.warning(
            "control.hmac_key is not set: control messages are not authenticated, so anyone "
            "who can write to %s can decide this pipeline's transactions",
            cfg.control_topic,
        )


def _build(make: Callable[[], _R]) -> _R:
    """A runtime, or one line and an exit status when it cannot be made (a sink or Kafka
    client refusing its settings)."""
    try:
        return make()
    except FatalError as exc:
        log.error("fatal: %s", exc)
        sys.exit(EXIT_FATAL)
    except KafkaException as exc:
        log.error("fatal: Kafka: %s", _kafka_reason(exc))
        sys.exit(EXIT_FATAL)
    except (TwophaseError, SinkError) as exc:
        log.error("cannot start: %s", exc)
        sys.exit(EXIT_FAILED)


def _run_until_signal(make: Callable[[], Any], rejoin_on: type[FatalError] | None = None) -> None:
    """Run a coordinator or participant (``make()`` builds it); every way it can end is one
    line and a status.

    0: stopped by a signal. 2 (EXIT_FATAL): configuration, authentication, a store that cannot
    do the work -- retrying cannot help. 1: anything else (with the traceback at DEBUG).
    A runtime that ends on ``rejoin_on`` is replaced by a new one (no exit).
    """
    # A crash in native code (librdkafka, a driver) prints every thread's Python stack to stderr
    # -- the process's log -- instead of leaving only a signal number behind. (A stderr with no
    # file descriptor, e.g. a test runner's capture, has nowhere to print it.)
    with suppress(AttributeError, ValueError, io.UnsupportedOperation):
        faulthandler.enable()
    stopping = threading.Event()
    current: list[Any] = []

    def stop(signum: int, _frame: Any) -> None:
        log.info("signal %s: stopping", signum)
        stopping.set()
        if current:
            current[-1].stop()

    # Once, for every runtime this process runs: a signal between two of them stops the next.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        current.append(_build(make))
        del current[:-1]
        # A signal while it was being built: it never runs (its clients go below).
        status = 0 if stopping.is_set() else _run_one(current[-1], stopping, rejoin_on)
        if status is None:
            continue
        # The runtime has closed what it closes; its last references go now, with the cycles
        # its callbacks make, so the librdkafka handles it does not close itself (the admin
        # client, the producers after their flush) are destroyed while the interpreter is whole
        # -- not by its exit, when a client's thread calling back into Python can crash the
        # process (SIGSEGV instead of the status).
        current.clear()
        gc.collect()
        if status:
            sys.exit(status)
        return


def _run_one(
    runtime: Any, stopping: threading.Event, rejoin_on: type[FatalError] | None
) -> int | None:
    """:func:`_run_until_signal` of one runtime: the exit status it ended with (0: stopped),
    or None when it ended on ``rejoin_on`` (to be replaced)."""
    debug = log.isEnabledFor(logging.DEBUG)
    try:
        runtime.run()
    except FatalError as exc:
        if rejoin_on is not None and isinstance(exc, rejoin_on):
            if stopping.is_set():  # a stop asked for while it was ending: a clean stop
                return 0
            log.warning("%s: starting again as a standby", exc)
            return None
        log.error("fatal: %s", exc)
        return EXIT_FATAL
    except KafkaException as exc:  # a Kafka call the runtime has no answer for: say which
        log.error("fatal: Kafka: %s", _kafka_reason(exc), exc_info=debug)
        return EXIT_FATAL
    except (RetriableError, SinkError) as exc:
        if stopping.is_set():  # a wait cut short by the signal: a clean stop
            log.info("stopped while waiting: %s", exc)
            return 0
        log.error("stopped: %s", exc, exc_info=debug)
        return EXIT_FAILED
    except Exception as exc:  # last resort: one line, never a traceback an operator must parse
        log.error(
            "stopped on an unexpected error: %s: %s (TWOPHASE_LOG_LEVEL=DEBUG shows where)",
            type(exc).__name__,
            exc,
            exc_info=debug,
        )
        return EXIT_FAILED
    return 0


def _kafka_reason(exc: KafkaException) -> str:
    err = exc.args[0] if exc.args else None
    return str(err.str()) if isinstance(err, KafkaError) else str(exc)


def _emit(data: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        human(data)


def _table(rows: dict[str, Any]) -> None:
    width = max((len(k) for k in rows), default=0) + 2
    for k, v in sorted(rows.items()):
        click.echo(f"{k:{width}}{v}")


def _columns(headers: list[str], rows: list[list[Any]]) -> None:
    """Rows under headers, each column as wide as its widest cell."""
    cells = [headers] + [["-" if c is None or c == "" else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for row in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _when(ts_ms: int | None) -> str:
    if not ts_ms:
        return "-"
    try:
        moment = datetime.fromtimestamp(ts_ms / 1000, UTC)
    except (OverflowError, OSError, ValueError):
        return f"{ts_ms}ms"  # a sender's clock (or a message) no date can show: the raw value
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class _Spinner:
    """A status line on stderr while a long operation runs: ``spinner(note)`` updates it.

    Silent when stderr is not a terminal, so scripts and logs get only the result.
    """

    FRAMES = "|/-\\"
    #: Redraw often enough to look alive, rarely enough to cost nothing.
    TICK_S = 0.1

    def __init__(self) -> None:
        self.enabled = sys.stderr.isatty()
        self.note = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, note: str) -> None:
        self.note = note

    def _draw(self) -> None:
        i = 0
        while not self._stop.wait(self.TICK_S):
            if not self.note:
                continue
            sys.stderr.write(f"\r\033[K{self.FRAMES[i % len(self.FRAMES)]} {self.note}")
            sys.stderr.flush()
            i += 1

    def __enter__(self) -> _Spinner:
        if self.enabled:
            self._thread = threading.Thread(target=self._draw, daemon=True, name="spinner")
            self._thread.start()
        return self

    def __exit__(
        self,
        _type: type[BaseException] | None,
        _exc: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


@click.group(
    epilog="Example: twophase status pipeline.yaml --json   (every command has --help)",
)
@click.version_option(package_name="twophase")
def main() -> None:
    """twophase: exactly-once, all-or-nothing delivery from Kafka into several stores at once."""
    from twophase.observability import configure_logging

    configure_logging()


@main.group()
def coordinator() -> None:
    """The coordinator: runs the commit cycles of one pipeline.

    \b
    Example: twophase coordinator run pipeline.yaml
    """


@coordinator.command("run")
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
def coordinator_run(config: str) -> None:
    """Run a coordinator (one leads per pipeline; others stand by).

    \b
    Example: twophase coordinator run pipeline.yaml
    """
    from twophase.coordinator.runtime import CoordinatorRuntime
    from twophase.errors import FencedError
    from twophase.observability import Metrics

    cfg = _load_to_run(config)
    _warn_unauthenticated(cfg)
    # Fenced by a newer leader (this one was cut off long enough to be replaced): the runtime
    # gives up the control partition and ends; the process comes back as a fresh standby, as a
    # supervisor's restart would, instead of exiting. Its metrics carry on.
    metrics = Metrics(cfg.pipeline, "coordinator")
    _run_until_signal(lambda: CoordinatorRuntime(cfg, metrics=metrics), rejoin_on=FencedError)


@main.group()
def participant() -> None:
    """A participant: consumes the source topics and writes the sinks.

    \b
    Example: TWOPHASE_PARTICIPANT_ID=worker-0 twophase participant run pipeline.yaml
    """


@participant.command("run")
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--id",
    "participant_id",
    default="",
    help="Participant id (default: $TWOPHASE_PARTICIPANT_ID or the host name).",
)
def participant_run(config: str, participant_id: str) -> None:
    """Run a participant worker.

    \b
    Example: TWOPHASE_PARTICIPANT_ID=worker-0 twophase participant run pipeline.yaml
    """
    from twophase.participants.runtime import AtLeastOnceRuntime, ParticipantRuntime

    cfg = _load_to_run(config)
    if cfg.participant.mode == "exactly_once":  # at-least-once reads no control messages
        _warn_unauthenticated(cfg)
    kind = AtLeastOnceRuntime if cfg.participant.mode == "at_least_once" else ParticipantRuntime
    _run_until_signal(lambda: kind(cfg, participant_id=participant_id))


@main.group()
def topics() -> None:
    """Create or inspect the pipeline's topics.

    \b
    Example: twophase topics describe pipeline.yaml
    """


@topics.command("create")
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def topics_create(config: str, as_json: bool) -> None:
    """Create the control, reply, dead-letter and source topics if missing.

    Settings come from control-topic/topics.yaml and the config; replication and
    min.insync.replicas are clamped to the broker count.

    \b
    Example: twophase topics create pipeline.yaml
    """
    from twophase.kafka import create_topics

    _operator_logs()
    try:
        result = create_topics(_load(config))
    except TwophaseError as exc:
        raise click.ClickException(str(exc)) from None
    except KafkaException as exc:
        raise click.ClickException(f"Kafka: {_kafka_reason(exc)}") from None
    _emit(result, as_json, _table)


@topics.command("describe")
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def topics_describe(config: str, as_json: bool) -> None:
    """Each topic of the pipeline: partitions, replication, key settings, offsets.

    Shows cleanup.policy, retention.ms, min.insync.replicas, max.message.bytes and
    unclean.leader.election.enable next to what control-topic/topics.yaml (clamped like
    `topics create`) asks for. Exit 1 when a topic is missing (the reply topic only noted: the
    replies then go to the control topic), the control topic is not one partition, or its
    settings differ from the expected ones.

    \b
    Example: twophase topics describe pipeline.yaml --json
    """
    from twophase.cli.status import describe_topics

    _operator_logs()
    cfg = _load(config)
    try:
        with _Spinner() as spinner:
            result = describe_topics(cfg, progress=spinner)
    except TwophaseError as exc:
        raise click.ClickException(str(exc)) from None

    def human(d: dict[str, Any]) -> None:
        click.echo(f"pipeline {d['pipeline']}  ({d['brokers']} brokers)")
        for t in d["topics"]:
            if not t["exists"]:
                note = f": {t['note']}" if t.get("note") else ""
                click.echo(f"{t['topic']}  ({t['role']})  MISSING{note}")
                continue
            click.echo(
                f"{t['topic']}  ({t['role']})  partitions {t['partitions']}  "
                f"replication {t['replication_factor']}"
            )
            for k, v in sorted(t["config"].items()):
                click.echo(f"    {k} = {v}")
            for k, d_ in sorted(t["drift"].items()):
                click.echo(f"    differs: {k} is {d_['actual']}, expected {d_['expected']}")
            for o in t["offsets"]:
                click.echo(
                    f"    [{o['partition']}] leader {o['leader']}  isr {o['isr']}  "
                    f"offsets {o['start']}..{o['end']}"
                )
        for problem in d["problems"]:
            click.echo(f"problem: {problem}")

    _emit(result, as_json, human)
    sys.exit(1 if result["problems"] else 0)


@main.command()
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--live",
    is_flag=True,
    help="Also run the start-up checks of a coordinator and a participant against the real "
    "Kafka and stores (credentials, topics, each sink's set-up: tables, server settings).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0.1),
    default=30.0,
    show_default=True,
    help="With --live: seconds to wait for Kafka and for each store.",
)
@click.option("--json", "as_json", is_flag=True, help="With --live: machine-readable output.")
def validate(config: str, live: bool, timeout_s: float, as_json: bool) -> None:
    """Validate a pipeline config, including every sink section.

    Without --live it connects to nothing. Errors name the field and the file, e.g.
    "config field 'commit.interval_ms' in pipeline.yaml: ...". With --live it also checks what
    the processes check at start-up, with the same code: Kafka answers and accepts the
    credentials, the topics exist, and every sink's set-up passes (PostgreSQL
    max_prepared_transactions > 0, the target table and its columns, a MongoDB replica set,
    ...). Like a participant, set-up creates what a sink creates when missing (marker tables).
    Exit 1 on any problem.

    \b
    Example: twophase validate pipeline.yaml --live
    """
    cfg = _load(config)
    if not live:
        click.echo(f"{config}: ok (pipeline {cfg.pipeline}, {len(cfg.sinks)} sinks)")
        return
    from twophase.cli.preflight import live_checks

    _operator_logs()
    try:
        with _Spinner() as spinner:
            result = live_checks(cfg, timeout_s=timeout_s, progress=spinner)
    except (TwophaseError, SinkError) as exc:
        raise click.ClickException(str(exc)) from None

    def human(d: dict[str, Any]) -> None:
        click.echo(f"kafka   {d['kafka']}")
        for name, state in sorted(d["topics"].items()):
            click.echo(f"topic   {name}: {state}")
        for name, state in sorted(d["sinks"].items()):
            click.echo(f"sink    {name}: {state}")
        for problem in d["problems"]:
            click.echo(f"problem {problem}")
        verdict = "ok" if not d["problems"] else f"{len(d['problems'])} problem(s)"
        click.echo(f"{config}: {verdict} against the live stack (pipeline {d['pipeline']})")

    _emit(result, as_json, human)
    sys.exit(1 if result["problems"] else 0)


@main.command()
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--max-commit-age",
    type=float,
    default=0.0,
    help="Unhealthy when the last commit is older than this many seconds (default: 10 intervals).",
)
@click.option(
    "--sinks/--no-sinks",
    "read_sinks",
    default=True,
    show_default=True,
    help="Connect to the sinks and show their committed positions.",
)
def status(config: str, as_json: bool, max_commit_age: float, read_sinks: bool) -> None:
    """Pipeline status from the control log, Kafka and the sinks; exit 1 when unhealthy.

    Shows the leader, the last transaction and commit, lag per partition and per participant,
    and each sink's committed positions. Health is judged from the control log and Kafka only:
    unhealthy when no coordinator leads, no participant holds a partition, records wait behind
    a commit older than --max-commit-age, a partition has not moved for commit.stall_alarm_s
    while records wait, or a commit stays unapplied for longer than --max-commit-age. A sink
    that cannot be read (each is given at most 10 s) is a warning.

    \b
    Example: twophase status pipeline.yaml --json
    """
    from twophase.cli.status import pipeline_status

    _operator_logs()
    cfg = _load(config)
    try:
        with _Spinner() as spinner:
            st = pipeline_status(
                cfg,
                max_commit_age_s=max_commit_age or 10 * cfg.commit.interval_ms / 1000,
                sinks=read_sinks,
                progress=spinner,
            )
    except (TwophaseError, SinkError) as exc:
        raise click.ClickException(str(exc)) from None

    def human(d: dict[str, Any]) -> None:
        click.echo(f"pipeline      {d['pipeline']}  ({'healthy' if d['healthy'] else 'UNHEALTHY'})")
        leader = d["leader"]
        if leader:
            leader = f"{leader} on {d['leader_host']} (last writer {d['last_coordinator'] or '-'})"
        click.echo(f"leader        {leader or '-'}")
        click.echo(f"last txn      {d['last_txn']}  (in flight: {d['in_flight'] or '-'})")
        age = d["last_commit_age_s"]
        click.echo(
            f"last commit   txn {d['last_commit_txn'] or '-'}, {age if age is not None else '-'}s ago"
        )
        click.echo(f"pending       {d['pending_commits'] or '-'}")
        click.echo(f"lag           {d['total_lag']} records")
        for p in d["partitions"]:
            click.echo(
                f"  {p['topic']}[{p['partition']}]  committed "
                f"{p['committed'] if p['committed'] >= 0 else '-'}  end {p['end']}  "
                f"lag {p['lag']}  owner {p['owner'] or '-'}"
            )
        click.echo(f"participants  {len(d['participants'])}")
        for m in d["participants"]:
            tps = ", ".join(f"{p['topic']}[{p['partition']}]" for p in m["partitions"]) or "-"
            click.echo(f"  {m['id']}  on {m['host']}  lag {m['lag']}  partitions {tps}")
        if d["sinks"] is not None:
            click.echo("sinks         last committed txn, committed positions")
            for sk in d["sinks"]:
                if "error" in sk:
                    click.echo(f"  {sk['name']}  ERROR {sk['error']}")
                    continue
                txn = sk["last_committed_txn"]
                last = "not reported" if "note" in sk else f"txn {'-' if txn is None else txn}"
                if sk["last_committed_by"]:
                    last += f" by {sk['last_committed_by']}"
                if sk["committed_age_s"] is not None:
                    last += f", {sk['committed_age_s']}s ago"
                pos = ", ".join(
                    f"{p['topic']}[{p['partition']}]={p['offset']}"
                    for p in sk["committed_positions"]
                )
                behind = (
                    f"  (behind the log on {len(sk['behind_log'])})" if sk["behind_log"] else ""
                )
                click.echo(f"  {sk['name']} ({sk['type']})  {last}  {pos or '-'}{behind}")
        for problem in d["problems"]:
            click.echo(f"problem       {problem}")
        for warning in d["warnings"]:
            click.echo(f"warning       {warning}")

    _emit(st, as_json, human)
    sys.exit(0 if st["healthy"] else 1)


@main.group()
def txn() -> None:
    """Inspect and resolve transactions: the decision log next to every sink.

    \b
    Example: twophase txn list pipeline.yaml
    """


@txn.command("list")
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def txn_list(config: str, as_json: bool) -> None:
    """In-doubt parts: prepared in a sink and undecided there, or committed and not acknowledged.

    For each part: the transaction, the participant, the sinks it is prepared in, the outcome
    the decision log gives it (commit / abort / none-yet, as recovery computes it), its age
    (from the PREPARE, when in the log tail), whether its owner is a live member of the group,
    and what happens next. Exit 1 when a sink could not be read.

    \b
    Example: twophase txn list pipeline.yaml --json
    """
    from twophase.cli.txn import list_txns

    _operator_logs()
    cfg = _load(config)
    try:
        with _Spinner() as spinner:
            result = list_txns(cfg, progress=spinner)
    except (TwophaseError, SinkError) as exc:
        raise click.ClickException(str(exc)) from None

    def human(d: dict[str, Any]) -> None:
        click.echo(
            f"pipeline {d['pipeline']}: last txn {d['last_txn']}, last decided "
            f"{d['last_decided']}, in flight {d['undecided'] or '-'}"
        )
        if not d["parts"]:
            click.echo("no in-doubt parts")
        else:
            _columns(
                ["TXN", "PARTICIPANT", "PREPARED IN", "OUTCOME", "AGE", "OWNER", "NEXT"],
                [
                    [
                        r["txn"],
                        r["participant"],
                        ",".join(r["prepared_in"]),
                        r["outcome"],
                        f"{r['age_s']}s" if r["age_s"] is not None else None,
                        r["owner"],
                        r["next"],
                    ]
                    for r in d["parts"]
                ],
            )
        for name, error in sorted(d["sink_errors"].items()):
            click.echo(f"sink {name}: ERROR {error}")

    _emit(result, as_json, human)
    sys.exit(1 if result["sink_errors"] else 0)


@txn.command("show")
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.argument("txn_id", metavar="TXN", type=click.IntRange(min=0))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--from-beginning",
    is_flag=True,
    help="Read every retained control message, not only the tail from the last checkpoint.",
)
def txn_show(config: str, txn_id: int, as_json: bool, from_beginning: bool) -> None:
    """One transaction: what the decision log saw of it and its state in each sink.

    The log part lists the PREPARE, every VOTE, the DECISION (parts, positions), APPLIED
    acknowledgements and COMPLETE, as far as the tail since the last checkpoint reaches
    (--from-beginning for older ones). Per part: the outcome recovery gives it and its state in
    every sink ("prepared", or for sinks on the SDK's BatchingSink the marker's state).

    \b
    Example: twophase txn show pipeline.yaml 42
    """
    from twophase.cli.txn import show_txn

    _operator_logs()
    cfg = _load(config)
    try:
        with _Spinner() as spinner:
            result = show_txn(cfg, txn_id, from_beginning=from_beginning, progress=spinner)
    except (TwophaseError, SinkError) as exc:
        raise click.ClickException(str(exc)) from None

    def human(d: dict[str, Any]) -> None:
        click.echo(f"txn {d['txn']} of {d['pipeline']}: {d['state']} (outcome: {d['outcome']})")
        lg = d["log"]
        click.echo(f"log (read from the {d['read_from']}; last decided {d['last_decided']}):")
        seen = False
        if lg["prepare"]:
            seen = True
            p = lg["prepare"]
            click.echo(
                f"  {_when(p['ts_ms'])}  PREPARE   by {p['sender']}, deadline {_when(p['deadline_ms'])}"
            )
        for v in lg["votes"]:
            seen = True
            ranges = ", ".join(
                f"{r['topic']}[{r['partition']}] {r['start']}..{r['end']} ({r['records']} rec)"
                for r in v["partitions"]
            )
            reason = f"  reason: {v['reason']}" if v["reason"] else ""
            click.echo(
                f"  {_when(v['ts_ms'])}  VOTE      {v['participant']} {v['vote']} gen "
                f"{v['generation']} sinks {','.join(v['sinks']) or '-'}  {ranges or 'no partitions'}{reason}"
            )
        if lg["decision"]:
            seen = True
            dd = lg["decision"]
            parts = ", ".join(f"{p['participant']}[{','.join(p['sinks'])}]" for p in dd["parts"])
            positions = ", ".join(
                f"{p['topic']}[{p['partition']}]={p['offset']}" for p in dd["positions"]
            )
            reason = f"  reason: {dd['reason']}" if dd.get("reason") else ""
            click.echo(
                f"  {_when(dd['ts_ms'])}  DECISION  {dd['outcome']} by {dd['sender']}  parts "
                f"{parts or '-'}  positions {positions or '-'}{reason}"
            )
        for a in lg["applied"]:
            seen = True
            click.echo(f"  {_when(a['ts_ms'])}  APPLIED   {a['part']} by {a['applied_by']}")
        if lg["complete"]:
            seen = True
            click.echo(f"  {_when(lg['complete']['ts_ms'])}  COMPLETE")
        if lg["pending"]:
            pend = lg["pending"]
            click.echo(f"  pending commit: parts {pend['parts']}, acknowledged {pend['acked']}")
        if not seen and d["read_from"] == "checkpoint":
            click.echo("  nothing in the tail since the last checkpoint (try --from-beginning)")
        click.echo("parts:")
        if not d["parts"]:
            click.echo("  none known")
        for p in d["parts"]:
            states = "  ".join(f"{k}: {v}" for k, v in sorted(p["sinks"].items()))
            click.echo(f"  {p['participant']}  {p['outcome']} ({p['basis']})")
            click.echo(f"      {states or 'no sinks'}")

    _emit(result, as_json, human)
    sys.exit(1 if result["sink_errors"] else 0)


@txn.command("resolve")
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.argument("txn_id", metavar="TXN", type=click.IntRange(min=0))
@click.option("--participant", "-p", required=True, help="Whose part of TXN to resolve.")
@click.option("--commit", "outcome", flag_value="commit", help="Commit the part.")
@click.option("--abort", "outcome", flag_value="abort", help="Abort the part.")
@click.option(
    "--force",
    is_flag=True,
    help="Abort a part the log has not decided yet (risky: see above).",
)
@_retry_for_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def txn_resolve(
    config: str,
    txn_id: int,
    participant: str,
    outcome: str | None,
    force: bool,
    retry_for: float,
    as_json: bool,
) -> None:
    """Apply an outcome to one part in every sink -- never against the decision log.

    \b
    --commit   only when the log has a commit decision naming the part (only the
               coordinator decides commits).
    --abort    when the log says abort: an abort decision, a commit that does not name
               the part, or presumed abort (TXN <= last decided, never committed).
    --abort --force
               also for a part the log has not decided. Risk: if the coordinator then
               decides commit, the part is gone from these sinks and cannot be committed.
    A logged outcome is never contradicted, with or without --force.

    Exit status: 0 applied, 1 a sink failed, 3 refused (the log does not allow it).
    A participant's next sweep acknowledges a resolved commit to the coordinator.

    \b
    Example: twophase txn resolve pipeline.yaml 42 --participant worker-1 --abort
    """
    from twophase.cli.txn import ResolveRefused, resolve_part
    from twophase.protocol.messages import Outcome

    _operator_logs()
    if outcome is None:
        raise click.UsageError("say --commit or --abort")
    if force and outcome == "commit":
        raise click.UsageError("--force only applies to --abort: commits are the coordinator's")
    cfg = _load(config)
    try:
        with _Spinner() as spinner:
            result = resolve_part(
                cfg,
                txn_id,
                participant,
                Outcome(outcome),
                force=force,
                retry_s=retry_for,
                progress=spinner,
            )
    except ResolveRefused as exc:
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "refused": True,
                        "txn": txn_id,
                        "participant": participant,
                        "asked": outcome,
                        "logged": exc.check.logged.value if exc.check.logged else "none-yet",
                        "basis": exc.check.basis,
                        "message": str(exc),
                    },
                    indent=2,
                    sort_keys=True,
                )
            )
        else:
            click.echo(f"Error: {exc}", err=True)
        sys.exit(EXIT_REFUSED)
    except (TwophaseError, SinkError) as exc:
        raise click.ClickException(str(exc)) from None

    def human(d: dict[str, Any]) -> None:
        if d["warning"]:
            click.echo(f"warning: {d['warning']}", err=True)
        click.echo(f"txn {d['txn']} part {d['participant']}: {d['outcome']} ({d['basis']})")
        for name, state in sorted(d["sinks"].items()):
            click.echo(f"  {name}: {state}")
        if d["note"]:
            click.echo(d["note"])

    _emit(result, as_json, human)
    sys.exit(0 if result["ok"] else 1)


@main.group()
def sinks() -> None:
    """Sink types: built-in and installed plugins.

    \b
    Example: twophase sinks list
    """


@sinks.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def sinks_list(as_json: bool) -> None:
    """List every sink type usable in a pipeline's sinks[].type.

    \b
    Example: twophase sinks list
    """
    from twophase.participants.registry import available_sinks

    _emit(available_sinks(), as_json, _table)


@sinks.command("maintain")
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option("--sink", "only", multiple=True, help="Only this sink (repeatable); default: all.")
@_retry_for_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def sinks_maintain(config: str, only: tuple[str, ...], retry_for: float, as_json: bool) -> None:
    """Run the upkeep of every sink of CONFIG that has any: for an iceberg sink, compaction of
    small files, snapshot expiry and removal of files nothing references (its `maintenance`
    settings, docs/iceberg.md). Safe while the pipeline runs: it never races a commit. Run it
    from cron or a Kubernetes CronJob, e.g. hourly.

    \b
    Example: twophase sinks maintain pipeline.yaml --sink lake
    """
    from twophase.cli.txn import open_sinks
    from twophase.retry import STORE

    _operator_logs()
    cfg = _load(config)
    unknown = set(only) - {str(s["name"]) for s in cfg.sinks}
    if unknown:
        raise click.ClickException(f"--sink: no sink named {sorted(unknown)} in {config}")
    chosen = cfg.model_copy(
        update={"sinks": [s for s in cfg.sinks if not only or s["name"] in only]}
    )
    results: dict[str, Any] = {}
    ready, errors = open_sinks(chosen, retry_s=retry_for)
    try:
        for sink in ready:
            try:
                done = STORE.call(sink.maintain, f"maintain {sink.name}", budget_s=retry_for)
            except SinkError as exc:
                errors[sink.name] = str(exc)
                continue
            results[sink.name] = dict(done) if done is not None else "nothing to maintain"
    finally:
        for sink in ready:
            sink.close()
    out = {"ok": not errors, "sinks": results, "errors": errors}
    _emit(
        out,
        as_json,
        lambda d: _table({**d["sinks"], **{k: f"ERROR {v}" for k, v in d["errors"].items()}}),
    )
    sys.exit(0 if not errors else 1)


@main.command("init")
@click.argument("path", default="pipeline.yaml", type=click.Path(dir_okay=False))
@click.option(
    "--name",
    default="orders",
    show_default=True,
    help="Pipeline name; also the source topic, the table and the collection.",
)
@click.option(
    "--stack-env",
    default=None,
    type=click.Path(dir_okay=False),
    help="The local stack's stack.env (default $TWOPHASE_STACK_DIR/stack.env, else ./.stack).",
)
@click.option("--force", is_flag=True, help="Overwrite PATH if it exists.")
def init(path: str, name: str, stack_env: str | None, force: bool) -> None:
    """Write a starter pipeline for the local stack (`make stack-up`) to PATH.

    It reads JSON records from the topic NAME into PostgreSQL, MongoDB and Parquet files
    (next to PATH), at the addresses of the running stack. An existing PATH is kept unless
    --force.

    \b
    Example: twophase init pipeline.yaml --name orders
    """
    # Local imports: this command is the only user, and edits stay out of the module header.
    import re
    from pathlib import Path

    import yaml

    from twophase.cli.starter import find_stack_env, read_stack_env, starter_pipeline
    from twophase.config import parse_config
    from twophase.participants.registry import build_sinks

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,47}", name):
        raise click.BadParameter(
            "1-48 of [A-Za-z0-9_.-], starting with a letter or digit", param_hint="--name"
        )
    target = Path(path)
    if target.exists() and not force:
        raise click.ClickException(f"{target} exists; keeping it (use --force to overwrite)")
    try:
        env = read_stack_env(find_stack_env(stack_env))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    files_dir = target.resolve().parent / f"{name}-files"
    text = starter_pipeline(name, env, files_dir, target)
    # Checked before writing: a starter that does not validate must never reach the disk.

    try:
        cfg = parse_config(yaml.safe_load(text), source=str(target), env={})
        build_sinks(cfg.sinks, pipeline=cfg.pipeline, participant="init", source=str(target))
    except ConfigError as exc:
        raise click.ClickException(f"internal error, starter invalid: {exc}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    click.echo(f"wrote {target}: pipeline {name}, source topic {name}, sinks pg, mongo, files")
    click.echo("next:")
    for step in (
        f"twophase validate {target}",
        f"twophase topics create {target}",
        f"twophase coordinator run {target}    # one terminal",
        f"twophase participant run {target}    # another",
        f"twophase status {target}",
    ):
        click.echo(f"  {step}")


if __name__ == "__main__":
    main()
