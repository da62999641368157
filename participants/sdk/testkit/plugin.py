"""pytest plugin of the sink conformance kit, registered as the ``pytest11`` entry point
``twophase_sinkkit`` (disable with ``-p no:twophase_sinkkit``).

It provides the ``twophase_kit`` fixture, built from the ``twophase_sink_factory`` fixture a sink
author writes, marks every case ``twophase_sinkkit``, and turns a suite's ``known_failures`` into
strict xfails. It loads into every pytest run of an environment with twophase installed, so it
adds no options, no autouse fixtures and nothing that runs unless a test asks for the kit.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from twophase.participants.sdk.testkit.kit import Kit, SinkFactory
from twophase.participants.sdk.testkit.suite import CASES, DeleteConformance, SinkConformance

MARKER = "twophase_sinkkit"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: a case of the twophase sink conformance kit")


@pytest.fixture
def twophase_kit(twophase_sink_factory: SinkFactory) -> Iterator[Kit]:
    """The kit's harness for one case: a pipeline of its own, cleaned up afterwards."""
    if not isinstance(twophase_sink_factory, SinkFactory):
        raise pytest.UsageError(
            "the twophase_sink_factory fixture must return a "
            f"twophase.participants.sdk.testkit.SinkFactory, not {type(twophase_sink_factory).__name__}"
        )
    kit = Kit(twophase_sink_factory)
    try:
        yield kit
    finally:
        kit.cleanup()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is None or not issubclass(cls, SinkConformance | DeleteConformance):
            continue
        unknown = set(cls.known_failures) - CASES
        if unknown:
            raise pytest.UsageError(
                f"{cls.__qualname__}.known_failures names no kit case: {sorted(unknown)}"
            )
        item.add_marker(MARKER)
        reason = cls.known_failures.get(getattr(item, "originalname", item.name))
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=f"known sink bug: {reason}", strict=True))
