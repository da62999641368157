"""Control-topic readers on the real stack (issue #14, PROTOCOL.md "Reader rules"): whatever
lands on a running pipeline's control topic -- a tag of any bytes, any header list, a signed
message with values its schema forbids, a signed DECISION nothing led to -- the coordinator and
the participant stay up, count the skip in ``twophase_control_messages_skipped_total``, and keep
committing; ``twophase status`` and ``twophase txn list`` keep working.

One pipeline serves the module (starting one costs more than the checks); each test compares
the counters before and after its own messages.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from click.testing import CliRunner
from confluent_kafka import Producer

from harness import Cluster, Scenario, produce, wait_until
from tests.e2e.e2e_support import SKIPPED, metric, scenario, scrape, settle, start
from twophase.cli.main import main
from twophase.config import PipelineConfig, load_config
from twophase.protocol.codec import AUTH_HEADER, _mac, encode, new_envelope
from twophase.protocol.messages import Checkpoint, Decision, Outcome, Payload, Prepare

#: Records produced per step: enough for several commit cycles across the 4 partitions.
BATCH = 200


@dataclass
class Live:
    s: Scenario
    cfg: PipelineConfig
    c: Cluster
    ports: dict[str, int]
    produced: int = 0

    def more_records_commit(self, timeout_s: float = 60) -> None:
        """Produce another batch and wait until every record so far is in every sink once."""
        produce(self.s.bootstrap, self.s.topic, self.produced, BATCH)
        self.produced += BATCH
        report = settle(self.s, self.c, set(range(self.produced)), timeout_s)
        for sink, r in report.items():
            assert r.ok and (r.rows, r.distinct) == (self.produced, self.produced), (sink, r)

    def skipped(self, name: str, kind: str) -> float:
        return metric(scrape(self.ports[name]), SKIPPED, kind=kind, pipeline=self.s.name)

    def alive(self) -> None:
        for name in self.ports:
            assert self.c.alive(name), f"{name} exited:\n{self.c.log_tail(name, 40)}"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("ctlreader")
    # A short vote timeout: a participant that ignores PREPAREs shows as aborted cycles within
    # seconds. No checkpoint during the test: a restarted coordinator folds every message.
    commit = {"interval_ms": 300, "vote_timeout_ms": 3000, "checkpoint_every": 100_000}
    s = scenario(tmp, "ctlreader", mongo=False, extra={"commit": commit})
    c = Cluster(s)
    ports = {"coord-0": start(c, "coordinator", "coord-0"), "p-0": start(c, "participant", "p-0")}
    pipeline = Live(s, load_config(s.config_path), c, ports)
    try:
        pipeline.more_records_commit(90)
        yield pipeline
    finally:
        c.stop_all()


def _send(cfg: PipelineConfig, value: bytes, headers: list[tuple[str, Any]]) -> None:
    producer = Producer({"bootstrap.servers": cfg.kafka.bootstrap_servers, "acks": "all"})
    producer.produce(cfg.control_topic, key=cfg.pipeline.encode(), value=value, headers=headers)
    assert producer.flush(30) == 0


def _signed(cfg: PipelineConfig, value: bytes) -> list[tuple[str, Any]]:
    assert cfg.hmac_key is not None
    return [(AUTH_HEADER, _mac(cfg.hmac_key, value).encode())]


def _envelope(cfg: PipelineConfig, payload: Payload) -> dict[str, Any]:
    value, _ = encode(new_envelope(cfg.pipeline, "coordinator:forged", payload), cfg.hmac_key)
    return dict(orjson.loads(value))


def _cli(*args: str) -> dict[str, Any]:
    """``twophase ARGS --json`` in this process: it must answer (healthy or not), not raise."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        result = CliRunner().invoke(main, [*args, "--json"], catch_exceptions=False)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert result.exit_code in (0, 1), (result.exit_code, result.stdout, result.stderr)
    return dict(json.loads(result.stdout))


def _cli_reads_the_log(live: Live) -> dict[str, Any]:
    config = str(live.s.config_path)
    status = _cli("status", config, "--no-sinks")
    listing = _cli("txn", "list", config)
    assert isinstance(status["last_decided"], int) and isinstance(listing["last_decided"], int)
    return status


def _wait_counted(live: Live, names: list[str], kind: str, want: dict[str, float]) -> None:
    for name in names:
        wait_until(
            lambda name=name: live.skipped(name, kind) >= want[name],  # type: ignore[misc]
            30,
            f"{name} to count {kind} skips",
        )
        assert live.skipped(name, kind) == want[name], (name, kind)


def test_any_auth_tag_and_any_header_list_is_a_counted_bad_auth_skip(live: Live) -> None:
    cfg = live.cfg
    value, headers = encode(
        new_envelope(cfg.pipeline, "coordinator:x", Prepare(10_000, 1)), cfg.hmac_key
    )
    tag = headers[0][1]
    header_lists: list[list[tuple[str, Any]]] = [
        [(AUTH_HEADER, b"\xff\xfe\x00")],  # the reported crash: non-ASCII bytes
        [(AUTH_HEADER, "é".encode() * 40)],
        [(AUTH_HEADER, None)],
        [(AUTH_HEADER, b"")],
        [(AUTH_HEADER, b"\x00" * 100_000)],  # huge
        [(AUTH_HEADER, tag), (AUTH_HEADER, tag)],  # duplicated, even when valid
        [(AUTH_HEADER, b"\xff" * 64), (AUTH_HEADER, tag)],
        [("other", b"\xff"), ("", None)],  # no tag at all
    ]
    before = {n: live.skipped(n, "bad_auth") for n in live.ports}
    for hl in header_lists:
        _send(cfg, value, hl)
    want = {n: before[n] + len(header_lists) for n in live.ports}
    _wait_counted(live, list(live.ports), "bad_auth", want)
    live.alive()
    live.more_records_commit()
    _cli_reads_the_log(live)
    live.alive()


def test_a_decision_nothing_led_to_is_skipped_and_the_pipeline_keeps_committing(
    live: Live,
) -> None:
    cfg = live.cfg
    last = _cli_reads_the_log(live)["last_decided"]
    # Authentic (signed with the pipeline's key), well-formed, and 500 transactions ahead; a
    # PREPARE and a CHECKPOINT from nowhere would move a reader just as far.
    forged: list[Payload] = [
        Decision(last + 500, Outcome.ABORT, reason="from nowhere"),
        Prepare(last + 600, 1),
        Checkpoint(last + 700),
    ]
    before = live.skipped("p-0", "out_of_sequence")
    for payload in forged:
        value, headers = encode(new_envelope(cfg.pipeline, "coordinator:x", payload), cfg.hmac_key)
        _send(cfg, value, headers)
    # Folded in, it made the participant take every PREPARE up to last + 500 as decided:
    # every cycle aborted on its vote timeout and nothing committed for ~500 cycles.
    live.more_records_commit()
    _wait_counted(live, ["p-0"], "out_of_sequence", {"p-0": before + len(forged)})
    live.alive()
    status = _cli_reads_the_log(live)
    assert status["last_decided"] < last + 500, status

    # A new coordinator recovers its transaction counter from the log: the forged messages are
    # refused there too (counted), and its numbers follow on from the real ones.
    live.c.kill("coord-0", 15)
    live.ports.pop("coord-0")
    live.ports["coord-1"] = start(live.c, "coordinator", "coord-1")
    _wait_counted(live, ["coord-1"], "out_of_sequence", {"coord-1": len(forged)})
    live.more_records_commit(90)
    live.alive()
    assert _cli_reads_the_log(live)["last_decided"] < last + 500


def test_signed_values_the_schema_forbids_are_counted_malformed(live: Live) -> None:
    cfg = live.cfg
    prepare = _envelope(cfg, Prepare(10_000, 1))
    decision = _envelope(cfg, Decision(10_000, Outcome.ABORT))
    bad: list[dict[str, Any]] = [
        {**prepare, "payload": {"txn": 3.7, "deadline_ms": 1}},
        {**prepare, "payload": {"txn": 1e300, "deadline_ms": 1}},
        {**prepare, "payload": {"txn": True, "deadline_ms": 1}},
        {**prepare, "payload": {"txn": "5", "deadline_ms": 1}},
        {**prepare, "payload": {"txn": 0, "deadline_ms": 1}},
        {**prepare, "payload": {"txn": 2**64, "deadline_ms": 1}},
        {**prepare, "version": "1"},
        {**prepare, "version": 1.0},
        {**prepare, "ts": -1},
        {**prepare, "id": 7},
        {**decision, "payload": {**decision["payload"], "txn": 3.0}},
        {**decision, "payload": {**decision["payload"], "outcome": ["abort"]}},
        {**decision, "payload": {**decision["payload"], "parts": [7]}},
        {**decision, "payload": {**decision["payload"], "positions": "0:1"}},
        {
            **decision,
            "payload": {
                **decision["payload"],
                "outcome": "commit",
                "parts": [{"participant": "p-0", "generation": 1, "sinks": [1]}],
            },
        },
    ]
    before = {n: live.skipped(n, "malformed") for n in live.ports}
    for raw in bad:
        value = json.dumps(raw).encode()  # json: it writes 2**64 too
        _send(cfg, value, _signed(cfg, value))
    want = {n: before[n] + len(bad) for n in live.ports}
    _wait_counted(live, list(live.ports), "malformed", want)
    live.alive()
    live.more_records_commit()
    _cli_reads_the_log(live)
    live.alive()
