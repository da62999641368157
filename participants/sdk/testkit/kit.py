"""The kit's harness: builds sink instances like the runtime does and reads what readers see."""

from __future__ import annotations

import logging
import multiprocessing
import signal
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from twophase.participants.sdk.errors import SinkError
from twophase.participants.sdk.records import PartId, Positions, Record, Rejected
from twophase.participants.sdk.sink import Sink, SinkContext
from twophase.participants.sdk.testkit._records import TOPIC, positions_of, record, records

__all__ = ["TOPIC", "Kit", "SinkFactory", "record", "records"]

T = TypeVar("T")

#: A crashing child imports the sink's package afresh (spawn) and does one part: seconds at most.
CRASH_CHILD_TIMEOUT_S = 120.0
#: Larger than any transaction number a test uses: "every open part is old enough to be stale".
_EVERY_TXN = 10**9


@dataclass(frozen=True)
class SinkFactory:
    """What the kit needs from a sink author, returned by the ``twophase_sink_factory`` fixture.

    * ``sink_class`` and ``config``: the sink and one ``sinks[]`` entry of a pipeline, exactly as a
      pipeline file would have it (``name`` is the sink's name). The kit builds every instance the
      way the runtime does -- ``sink_class.from_mapping(config, context)`` then ``setup()`` -- so
      each instance is a new process as far as the store can tell: new connections, no memory.
    * ``committed_ids``: reads the store the way a reader of the target would, and returns the
      ``id`` field of every record it sees, duplicates included. Every record the kit writes has
      the value ``{"id": "<topic>:<partition>:<offset>", "n": <offset>, "text": "row <offset>"}``.
    * ``bad_value``: a record value the store refuses (its ``write`` returns it as ``Rejected``);
      ``None`` skips that case, saying so.
    * ``large_batch``: records in the large-batch case; lower it for slow stores.
    """

    sink_class: type[Sink]
    config: Mapping[str, Any]
    committed_ids: Callable[[], Iterable[str]]
    bad_value: Mapping[str, Any] | None = None
    large_batch: int = 20_000


class Kit:
    """One test's view of the sink under test: fresh instances, parts, and what readers see.

    Every test runs in a pipeline of its own (``self.pipeline``), so tests sharing a store never
    see each other's parts. Instances are closed, and parts left prepared or open are aborted,
    at the end of the test, so a failing test leaves no locks behind.
    """

    def __init__(self, factory: SinkFactory) -> None:
        self.factory = factory
        self.pipeline = f"kit-{uuid.uuid4().hex[:10]}"
        self.sink_name = str(factory.config["name"])
        self._made: list[Sink] = []
        self._pipelines = {self.pipeline}

    # -- building -------------------------------------------------------------------------------

    def context(self, participant: str, pipeline: str | None = None) -> SinkContext:
        pipeline = pipeline or self.pipeline
        log = logging.getLogger(f"twophase.sinkkit.{self.sink_name}")
        return SinkContext(pipeline, participant, self.sink_name, log)

    def sink(self, participant: str = "w1", *, pipeline: str | None = None) -> Sink:
        """A new, set-up instance: a new process as far as the store can tell."""
        ctx = self.context(participant, pipeline)
        self._pipelines.add(ctx.pipeline)
        sink = self.factory.sink_class.from_mapping(dict(self.factory.config), ctx)
        self._made.append(sink)
        sink.setup()
        return sink

    def part(self, txn: int, participant: str = "w1", *, pipeline: str | None = None) -> PartId:
        return PartId(pipeline or self.pipeline, txn, participant)

    # -- driving --------------------------------------------------------------------------------

    def run(
        self,
        sink: Sink,
        part: PartId,
        batch: Sequence[Record],
        *,
        prepare: bool = True,
        commit: bool = False,
        positions: Positions | None = None,
    ) -> list[Rejected]:
        """begin, write ``batch`` in one call, then prepare and commit as asked."""
        sink.begin(part)
        rejected = list(sink.write(part, batch))
        if prepare or commit:
            sink.prepare(part, positions_of(batch) if positions is None else positions)
        if commit:
            sink.commit(part)
        return rejected

    def visible(self) -> Counter[str]:
        """Record ids readers of the target see, with how often each one is there."""
        return Counter(self.factory.committed_ids())

    def crash_after(
        self, participant: str, *, prepared: tuple[int, Sequence[Record]], open_: tuple[int, int]
    ) -> None:
        """In a new process: prepare ``prepared``, begin and write ``open_``, then SIGKILL itself.

        ``prepared`` is ``(txn, records)``; ``open_`` is ``(txn, count)`` records written from
        offset ``10_000 * txn``. The process dies without closing anything, like a real crash.
        """
        from twophase.participants.sdk.testkit import _crash

        ctx = multiprocessing.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        child = ctx.Process(
            target=_crash.run,
            args=(
                self.factory.sink_class,
                dict(self.factory.config),
                self.pipeline,
                participant,
                prepared[0],
                [r.offset for r in prepared[1]],
                open_,
                writer,
            ),
            name="twophase-sinkkit-crash",
        )
        child.start()
        writer.close()
        child.join(CRASH_CHILD_TIMEOUT_S)
        report = reader.recv() if reader.poll() else "no report"
        reader.close()
        if child.is_alive():
            child.kill()
            child.join()
            raise AssertionError(f"the crashing process hung ({report})")
        if child.exitcode != -signal.SIGKILL:
            raise AssertionError(f"the process failed before its crash point: {report}")

    # -- clean-up -------------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Close every instance; abort what the test left prepared or open, in every pipeline."""
        for sink in self._made:
            _quietly(sink.close, f"close {sink.name}")
        for pipeline in sorted(self._pipelines):
            sweeper = self.factory.sink_class.from_mapping(
                dict(self.factory.config), self.context("kit-cleanup", pipeline)
            )
            try:
                sweeper.setup()
                for part in sweeper.in_doubt():
                    if part.pipeline != pipeline:
                        continue  # a sink that lists other pipelines' parts: the case says so
                    _quietly(partial(sweeper.abort, part), f"abort {part.token}")
                for part in _quietly(partial(sweeper.stale_parts, _EVERY_TXN), "stale") or []:
                    _quietly(partial(sweeper.abort, part), f"abort {part.token}")
            except SinkError as exc:
                warnings.warn(f"sink kit clean-up of {pipeline}: {exc}", stacklevel=1)
            finally:
                _quietly(sweeper.close, "close")
        self._made.clear()


def _quietly(fn: Callable[[], T], what: str) -> T | None:
    """Clean-up is best effort: a sink's error here must not hide the case's own outcome (the
    cases check the same calls and report them properly)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported as a warning, never swallowed silently
        warnings.warn(f"sink kit clean-up: {what}: {type(exc).__name__}: {exc}", stacklevel=1)
        return None
