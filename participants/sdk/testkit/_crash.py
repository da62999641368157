"""The kit's crashing process: run by ``multiprocessing`` (spawn), so it imports everything anew."""

from __future__ import annotations

import logging
import os
import signal
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from twophase.participants.sdk.records import PartId
from twophase.participants.sdk.sink import Sink, SinkContext
from twophase.participants.sdk.testkit._records import positions_of, record


def run(
    sink_class: type[Sink],
    config: dict[str, Any],
    pipeline: str,
    participant: str,
    prepared_txn: int,
    prepared_offsets: Sequence[int],
    open_part: tuple[int, int],
    report: Connection,
) -> None:
    """Prepare one part, leave the next one open with records written, and die by SIGKILL."""
    try:
        ctx = SinkContext(pipeline, participant, str(config["name"]), logging.getLogger("crash"))
        sink = sink_class.from_mapping(config, ctx)
        sink.setup()
        part = PartId(pipeline, prepared_txn, participant)
        batch = [record(o) for o in prepared_offsets]
        sink.begin(part)
        sink.write(part, batch)
        sink.prepare(part, positions_of(batch))
        txn, count = open_part
        part = PartId(pipeline, txn, participant)
        sink.begin(part)
        sink.write(part, [record(10_000 * txn + i) for i in range(count)])
        report.send("reached the crash point")
    except BaseException:  # noqa: BLE001 - the parent reports why, whatever it was
        report.send(traceback.format_exc())
        report.close()
        os._exit(3)
    report.close()
    os.kill(os.getpid(), signal.SIGKILL)
