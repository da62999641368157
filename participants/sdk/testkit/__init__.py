"""The sink conformance kit: a generated test suite every sink must pass, as a pytest plugin.

A sink author writes one fixture and one class::

    import pytest
    from twophase.participants.sdk.testkit import SinkConformance, SinkFactory

    @pytest.fixture
    def twophase_sink_factory(tmp_path) -> SinkFactory:
        return SinkFactory(
            sink_class=MySink,
            config={"name": "mine", "type": "mine", "path": str(tmp_path / "store")},
            committed_ids=lambda: read_ids_like_a_reader(tmp_path / "store"),
            bad_value={"id": "x", "n": "not a number", "text": ""},
        )

    class TestMySink(SinkConformance):
        pass

A sink that applies deletes (``supports_deletes``) also subclasses ``DeleteConformance`` next to
a factory configured to apply them, keyed on the value's ``id`` field (``docs/cdc.md``).

The plugin (entry point ``pytest11: twophase_sinkkit``, installed with twophase) supplies the
``twophase_kit`` fixture the cases use. See ``docs/write-a-sink.md``.
"""

import pytest

# Before the imports below: a failed case then shows both sides of its comparison, as in a test
# module (pytest rewrites plugin modules only when it can list the installed files).
pytest.register_assert_rewrite(
    "twophase.participants.sdk.testkit.kit", "twophase.participants.sdk.testkit.suite"
)

from twophase.participants.sdk.testkit.kit import TOPIC, Kit, SinkFactory, record, records  # noqa: E402
from twophase.participants.sdk.testkit.suite import (  # noqa: E402
    CASES,
    DeleteConformance,
    SinkConformance,
)

__all__ = [
    "CASES",
    "TOPIC",
    "DeleteConformance",
    "Kit",
    "SinkConformance",
    "SinkFactory",
    "record",
    "records",
]
