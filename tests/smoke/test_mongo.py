"""MongoDB multi-document transactions on the stack's SecantusDB (what the Mongo sink's
commit step relies on)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.database import Database

pytestmark = pytest.mark.stack


@pytest.fixture
def db(mongo_uri: str, unique_name: str) -> Iterator[Database[dict[str, Any]]]:
    client: MongoClient[dict[str, Any]] = MongoClient(mongo_uri, serverSelectionTimeoutMS=10_000)
    try:
        database = client[unique_name]
        # Created up front so the tests below exercise transactions, not implicit creation.
        database.create_collection("target")
        database.create_collection("markers")
        yield database
        client.drop_database(unique_name)
    finally:
        client.close()


def test_transactions_are_supported(db: Database[dict[str, Any]]) -> None:
    hello = db.client.admin.command("hello")
    assert hello.get("setName"), "transactions need a replica-set topology"
    assert db.client.topology_description.topology_type_name == "ReplicaSetWithPrimary"


def test_aborted_transaction_leaves_nothing(db: Database[dict[str, Any]]) -> None:
    with db.client.start_session() as session:
        session.start_transaction()
        db.target.insert_one({"_id": "a"}, session=session)
        db.markers.insert_one({"_id": "txn-1"}, session=session)
        # Visible inside the transaction, invisible outside it.
        assert db.target.count_documents({}, session=session) == 1
        assert db.target.count_documents({}) == 0
        session.abort_transaction()
    assert list(db.target.find()) == []
    assert list(db.markers.find()) == []


def test_committed_transaction_leaves_both_documents(db: Database[dict[str, Any]]) -> None:
    with db.client.start_session() as session, session.start_transaction():
        db.target.insert_one({"_id": "a", "v": 1}, session=session)
        db.markers.insert_one({"_id": "txn-1", "positions": {"0": 5}}, session=session)
    assert list(db.target.find()) == [{"_id": "a", "v": 1}]
    assert list(db.markers.find()) == [{"_id": "txn-1", "positions": {"0": 5}}]
