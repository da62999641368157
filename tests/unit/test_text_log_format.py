"""Text log lines carry the transaction and partitions they are about, like JSON lines do."""

from __future__ import annotations

import io
import logging

from twophase.observability import _ContextFilter, _TextFormatter, log_context, txn_extra


def _logger() -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(_ContextFilter())
    handler.setFormatter(_TextFormatter())
    log = logging.getLogger("twophase.test.textformat")
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.DEBUG)
    return log, out


def test_a_line_about_one_partition_names_it() -> None:
    log, out = _logger()
    log.info("part prepared", extra=txn_extra(12, [("orders", 3)]))
    assert out.getvalue().rstrip().endswith("part prepared [txn=12 orders[3]]")


def test_what_the_message_says_already_is_not_repeated() -> None:
    log, out = _logger()
    log.info("txn=12 prepared orders[3]", extra=txn_extra(12, [("orders", 3)]))
    assert out.getvalue().rstrip().endswith("txn=12 prepared orders[3]")


def test_lines_inside_a_transactions_work_get_its_partitions() -> None:
    log, out = _logger()
    with log_context(txn_extra(7, [("orders", 0), ("orders", 1)])):
        log.warning("sink retry")
    log.info("no context")
    first, second = out.getvalue().splitlines()
    assert first.endswith("sink retry [txn=7 orders[0],orders[1]]")
    assert second.endswith("no context")


def test_a_traceback_stays_below_the_tagged_line() -> None:
    log, out = _logger()
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("write failed", extra=txn_extra(9, [("orders", 1)]))
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("write failed [txn=9 orders[1]]")
    assert lines[-1] == "ValueError: boom"
