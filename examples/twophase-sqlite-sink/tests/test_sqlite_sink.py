"""The conformance kit against the SQLite sink (fixture: ``twophase_sink_factory`` in conftest)."""

import dataclasses

import pytest

from twophase.participants.sdk.testkit import DeleteConformance, SinkConformance, SinkFactory


class TestSqliteSink(SinkConformance):
    pass


class TestSqliteSinkDeletes(DeleteConformance):
    """With ``key: id`` the sink keeps one row per id and applies deletes."""

    @pytest.fixture
    def twophase_sink_factory(self, twophase_sink_factory: SinkFactory) -> SinkFactory:
        keyed = {**twophase_sink_factory.config, "key": "id"}
        return dataclasses.replace(twophase_sink_factory, config=keyed)
