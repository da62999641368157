"""``twophase txn list|show|resolve`` against real prepared PostgreSQL transactions.

No coordinator runs here: the test writes the decision log itself (PREPARE / DECISION messages on
the real control topic, as a coordinator would), so each case has exactly the log it needs. The
parts are real ``PREPARE TRANSACTION``s made with the PostgresSink, as a participant that then
died leaves them. What the CLI did is read back from ``pg_prepared_xacts`` and the table.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import Scenario
from tests.cli.conftest import (
    new_scenario,
    pg_gids,
    pg_ids,
    prepare_pg_part,
    rollback_leftovers,
    run_cli,
    run_json,
    send_control,
)
from twophase.config import PipelineConfig, load_config
from twophase.protocol.messages import Decision, Outcome, Part, Position, Prepare

DEAD = "p-dead"


@pytest.fixture
def pipeline(
    tmp_path: Path, stack_env: dict[str, str]
) -> Iterator[tuple[Scenario, PipelineConfig]]:
    s = new_scenario(tmp_path, "cli-txn")
    try:
        yield s, load_config(s.config_path)
    finally:
        rollback_leftovers(s)


def _gid(s: Scenario, txn: int, participant: str = DEAD) -> str:
    return f"twophase:pg:{s.name}~{txn:012d}~{participant}"


def _row(listing: dict[str, Any], txn: int, participant: str = DEAD) -> dict[str, Any]:
    rows = [r for r in listing["parts"] if r["txn"] == txn and r["participant"] == participant]
    assert len(rows) == 1, listing
    return rows[0]


def _resolve(s: Scenario, txn: int, *flags: str, exit_code: int) -> Any:
    return run_json(
        "txn",
        "resolve",
        str(s.config_path),
        str(txn),
        "--participant",
        DEAD,
        *flags,
        exit_code=exit_code,
    )


def test_a_logged_commit_is_applied_and_never_contradicted(
    pipeline: tuple[Scenario, PipelineConfig],
) -> None:
    s, cfg = pipeline
    prepare_pg_part(cfg, s, 1, DEAD, [1, 2, 3])
    send_control(
        cfg,
        Prepare(1, 0),
        Decision(1, Outcome.COMMIT, (Part(DEAD, 5, ("pg",)),), (Position(s.topic, 0, 10_003),)),
    )
    assert pg_gids(s) == [_gid(s, 1)]

    row = _row(run_json("txn", "list", str(s.config_path)), 1)
    assert row["prepared_in"] == ["pg"]
    assert row["outcome"] == "commit"
    assert row["owner"] == "gone"  # nobody is in the source group
    assert row["age_s"] is not None and row["age_s"] >= 0

    shown = run_json("txn", "show", str(s.config_path), "1")
    assert shown["outcome"] == "commit"
    assert shown["log"]["prepare"] is not None
    assert shown["log"]["decision"]["parts"][0]["participant"] == DEAD
    assert shown["parts"] == [
        {
            "participant": DEAD,
            "outcome": "commit",
            "basis": f"DECISION commit naming {DEAD}",
            # The files sink is a BatchingSink: its state is read from its markers, and this part
            # has none there.
            "sinks": {"pg": "prepared", "files": "unknown"},
        }
    ]

    refused = _resolve(s, 1, "--abort", exit_code=3)
    assert refused["refused"] and refused["logged"] == "commit"
    assert "would contradict" in refused["message"]
    refused = _resolve(s, 1, "--abort", "--force", exit_code=3)  # not even with --force
    assert refused["logged"] == "commit"
    assert pg_gids(s) == [_gid(s, 1)] and pg_ids(s) == []

    human = run_cli("txn", "resolve", str(s.config_path), "1", "-p", DEAD, "--abort")
    assert human.exit_code == 3
    assert "refused: the decision log says commit" in human.stderr

    done = _resolve(s, 1, "--commit", exit_code=0)
    assert done["sinks"] == {"pg": "committed", "files": "not prepared here"}
    assert pg_gids(s) == [] and pg_ids(s) == [1, 2, 3]
    # Committed, not acknowledged: still listed (a participant's sweep acknowledges it), but
    # prepared nowhere.
    row = _row(run_json("txn", "list", str(s.config_path)), 1)
    assert row["prepared_in"] == [] and row["acknowledged"] is False

    again = _resolve(s, 1, "--commit", exit_code=0)  # idempotent: the decision names pg
    assert again["sinks"]["pg"] == "already committed"
    assert pg_ids(s) == [1, 2, 3]


def test_a_logged_abort_refuses_commit_and_aborts(
    pipeline: tuple[Scenario, PipelineConfig],
) -> None:
    s, cfg = pipeline
    prepare_pg_part(cfg, s, 2, DEAD, [20, 21])
    send_control(cfg, Prepare(2, 0), Decision(2, Outcome.ABORT, reason="vote timeout"))
    assert _row(run_json("txn", "list", str(s.config_path)), 2)["outcome"] == "abort"

    refused = _resolve(s, 2, "--commit", exit_code=3)
    assert refused["logged"] == "abort" and "vote timeout" in refused["basis"]
    assert pg_gids(s) == [_gid(s, 2)]

    done = _resolve(s, 2, "--abort", exit_code=0)
    assert done["sinks"]["pg"] == "aborted" and not done["forced"]
    assert pg_gids(s) == [] and pg_ids(s) == []
    assert run_json("txn", "list", str(s.config_path))["parts"] == []


def test_an_undecided_part_needs_force_to_abort_and_can_never_be_committed(
    pipeline: tuple[Scenario, PipelineConfig],
) -> None:
    s, cfg = pipeline
    send_control(cfg, Prepare(1, 0), Decision(1, Outcome.ABORT), Prepare(2, 0))
    prepare_pg_part(cfg, s, 2, DEAD, [7])
    listing = run_json("txn", "list", str(s.config_path))
    assert listing["undecided"] == [2]
    row = _row(listing, 2)
    assert row["outcome"] == "none-yet" and row["next"] == "waits for the coordinator's decision"

    refused = _resolve(s, 2, "--commit", exit_code=3)
    assert refused["logged"] == "none-yet"
    assert "only the coordinator decides commits" in refused["message"]
    refused = _resolve(s, 2, "--abort", exit_code=3)
    assert "--force" in refused["message"]
    assert pg_gids(s) == [_gid(s, 2)]

    usage = run_cli("txn", "resolve", str(s.config_path), "2", "-p", DEAD, "--commit", "--force")
    assert usage.exit_code == 2 and "--force only applies to --abort" in usage.stderr

    forced = _resolve(s, 2, "--abort", "--force", exit_code=0)
    assert forced["forced"] and "UnknownPartError" in forced["warning"]
    assert forced["sinks"]["pg"] == "aborted"
    assert pg_gids(s) == [] and pg_ids(s) == []


def test_presumed_abort_allows_abort_without_force(
    pipeline: tuple[Scenario, PipelineConfig],
) -> None:
    s, cfg = pipeline
    # txn 4 was never decided, and the coordinator moved on: 5 committed, naming someone else.
    prepare_pg_part(cfg, s, 4, DEAD, [40])
    prepare_pg_part(cfg, s, 5, DEAD, [50])
    send_control(
        cfg,
        Prepare(4, 0),
        Prepare(5, 0),
        Decision(5, Outcome.COMMIT, (Part("p-other", 5, ("pg",)),), (Position(s.topic, 0, 1),)),
    )
    listing = run_json("txn", "list", str(s.config_path))
    assert _row(listing, 4)["outcome"] == "abort"
    assert _row(listing, 4)["basis"].startswith("presumed abort")
    assert _row(listing, 5)["basis"] == f"DECISION commit does not name {DEAD}"

    assert _resolve(s, 5, "--commit", exit_code=3)["logged"] == "abort"
    assert _resolve(s, 4, "--abort", exit_code=0)["sinks"]["pg"] == "aborted"
    assert _resolve(s, 5, "--abort", exit_code=0)["sinks"]["pg"] == "aborted"
    assert pg_gids(s) == [] and pg_ids(s) == []

    human = run_cli("txn", "list", str(s.config_path))
    assert human.exit_code == 0
    # p-other's committed part is unacknowledged (nobody runs here to acknowledge it); p-dead's
    # parts are resolved.
    assert "PARTICIPANT" in human.stdout and "p-other" in human.stdout
    assert DEAD not in human.stdout
