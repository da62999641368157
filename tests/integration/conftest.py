"""Fixtures the PostgreSQL sink tests share (their helpers live in ``test_sink_postgres``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from test_sink_postgres import PgEnv, _base_name


@pytest.fixture
def env(pg_dsn: str, unique_name: Any) -> Iterator[PgEnv]:
    """A test's names in the stack's PostgreSQL, a reader, and the clean-up of what it made."""
    pg_env = PgEnv(pg_dsn, _base_name(unique_name))
    try:
        yield pg_env
    finally:
        pg_env.cleanup()
