"""The ``twophase`` command line."""

from __future__ import annotations

import json
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

import click

from twophase.config import PipelineConfig, load_config
from twophase.errors import ConfigError, FatalError, TwophaseError

log = logging.getLogger("twophase.cli")


def _load(path: str) -> PipelineConfig:
    try:
        return load_config(path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def _run_until_signal(runtime: Any) -> None:
    def stop(signum: int, _frame: Any) -> None:
        log.info("signal %s: stopping", signum)
        runtime.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        runtime.run()
    except FatalError as exc:
        log.error("fatal: %s", exc)
        sys.exit(2)


def _emit(data: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    else:
        human(data)


def _table(rows: dict[str, Any]) -> None:
    width = max((len(k) for k in rows), default=0) + 2
    for k, v in sorted(rows.items()):
        click.echo(f"{k:{width}}{v}")


@click.group()
@click.version_option(package_name="twophase")
def main() -> None:
    """twophase: exactly-once, all-or-nothing delivery from Kafka into several stores at once."""
    from twophase.observability import configure_logging

    configure_logging()


@main.group()
def coordinator() -> None:
    """The coordinator: runs the commit cycles of one pipeline."""


@coordinator.command("run")
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
def coordinator_run(config: str) -> None:
    """Run a coordinator (one leads per pipeline; others stand by).

    Example: twophase coordinator run pipeline.yaml
    """
    from coordinator.runtime import CoordinatorRuntime

    _run_until_signal(CoordinatorRuntime(_load(config)))


@main.group()
def participant() -> None:
    """A participant: consumes the source topics and writes the sinks."""


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

    Example: TWOPHASE_PARTICIPANT_ID=worker-0 twophase participant run pipeline.yaml
    """
    from participants.runtime import ParticipantRuntime

    cfg = _load(config)
    try:
        runtime = ParticipantRuntime(cfg, participant_id=participant_id)
    except TwophaseError as exc:
        raise click.ClickException(str(exc)) from None
    _run_until_signal(runtime)


@main.group()
def topics() -> None:
    """Create or inspect the pipeline's topics."""


@topics.command("create")
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def topics_create(config: str, as_json: bool) -> None:
    """Create the control, dead-letter and source topics if missing.

    Example: twophase topics create pipeline.yaml
    """
    from twophase.kafka import create_topics

    try:
        result = create_topics(_load(config))
    except TwophaseError as exc:
        raise click.ClickException(str(exc)) from None
    _emit(result, as_json, _table)


@main.command()
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
def validate(config: str) -> None:
    """Validate a pipeline config, including every sink section.

    Example: twophase validate pipeline.yaml
    """
    from participants.registry import build_sinks

    cfg = _load(config)
    try:
        build_sinks(cfg.sinks, pipeline=cfg.pipeline, participant=cfg.participant_id, source=config)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{config}: ok (pipeline {cfg.pipeline}, {len(cfg.sinks)} sinks)")


@main.command()
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--max-commit-age",
    type=float,
    default=0.0,
    help="Unhealthy when the last commit is older than this many seconds (default: 10 intervals).",
)
def status(config: str, as_json: bool, max_commit_age: float) -> None:
    """Pipeline status from the control log and Kafka; exit 1 when unhealthy.

    Example: twophase status pipeline.yaml --json
    """
    from twophase.status import pipeline_status

    cfg = _load(config)
    try:
        st = pipeline_status(
            cfg, max_commit_age_s=max_commit_age or 10 * cfg.commit.interval_ms / 1000
        )
    except TwophaseError as exc:
        raise click.ClickException(str(exc)) from None

    def human(d: dict[str, Any]) -> None:
        click.echo(f"pipeline      {d['pipeline']}  ({'healthy' if d['healthy'] else 'UNHEALTHY'})")
        click.echo(f"leader        {d['leader'] or '-'}")
        click.echo(f"last txn      {d['last_txn']}  (in flight: {d['in_flight'] or '-'})")
        age = d["last_commit_age_s"]
        click.echo(
            f"last commit   txn {d['last_commit_txn'] or '-'}, {age if age is not None else '-'}s ago"
        )
        click.echo(f"pending       {d['pending_commits'] or '-'}")
        click.echo(f"lag           {d['total_lag']} records")
        for p in d["partitions"]:
            click.echo(
                f"  {p['topic']}[{p['partition']}]  committed {p['committed']}  end {p['end']}  lag {p['lag']}  owner {p['owner'] or '-'}"
            )
        for problem in d["problems"]:
            click.echo(f"problem       {problem}")

    _emit(st, as_json, human)
    sys.exit(0 if st["healthy"] else 1)


@main.group()
def sinks() -> None:
    """Sink types: built-in and installed plugins."""


@sinks.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def sinks_list(as_json: bool) -> None:
    """List every sink type usable in a pipeline's sinks[].type.

    Example: twophase sinks list
    """
    from participants.registry import available_sinks

    _emit(available_sinks(), as_json, _table)


if __name__ == "__main__":
    main()
