"""The conformance kit against the SQLite sink (fixture: ``twophase_sink_factory`` in conftest)."""

from twophase.participants.sdk.testkit import SinkConformance


class TestSqliteSink(SinkConformance):
    pass
