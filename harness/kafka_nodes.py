"""Which Kafka node holds what: the leader of a partition, a transactional id's coordinator.

For tests on the three-broker stack (``TWOPHASE_KAFKA_BROKERS=3 stack/stack.sh``) that kill the
node that matters. Answers come from a fresh metadata request, so they follow leader moves.

    python -m harness.kafka_nodes leader TOPIC PARTITION [--bootstrap HOST:PORT,...]
    python -m harness.kafka_nodes txn-coordinator TRANSACTIONAL_ID [--bootstrap ...]

(``--bootstrap`` defaults to the stack's ``TWOPHASE_KAFKA_BOOTSTRAP``.)
"""

from __future__ import annotations

import argparse
import sys

from confluent_kafka.admin import AdminClient

__all__ = [
    "CONSUMER_OFFSETS_TOPIC",
    "TRANSACTION_STATE_TOPIC",
    "group_coordinator_of",
    "java_string_hash",
    "leader_of",
    "txn_coordinator_of",
    "coordinator_partition",
]

#: Kafka's internal topic of transaction state; its partition count is read, never assumed
#: (the stack sets ``transaction.state.log.num.partitions=8``, Kafka's default is 50).
TRANSACTION_STATE_TOPIC = "__transaction_state"
#: Kafka's internal topic of consumer group state: a group's coordinator leads its partition.
CONSUMER_OFFSETS_TOPIC = "__consumer_offsets"

#: One metadata request; a cluster that just lost a node answers well inside this.
METADATA_TIMEOUT_S = 10.0


def java_string_hash(s: str) -> int:
    """Java's ``String.hashCode``: 31-polynomial over UTF-16 code units, 32-bit signed."""
    h = 0
    data = s.encode("utf-16-be")
    for i in range(0, len(data), 2):
        h = (31 * h + int.from_bytes(data[i : i + 2], "big")) & 0xFFFFFFFF
    return h - (1 << 32) if h & 0x80000000 else h


def coordinator_partition(key: str, partitions: int) -> int:
    """The partition of Kafka's state topic holding ``key`` (a transactional id in
    ``__transaction_state``, a group id in ``__consumer_offsets``), as the broker computes it:
    ``Utils.abs(key.hashCode) % partitions`` (``Utils.abs(MIN_VALUE)`` is 0)."""
    h = java_string_hash(key)
    return (0 if h == -(1 << 31) else abs(h)) % partitions


def _admin(bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap})


def _partition_leaders(bootstrap: str, topic: str) -> dict[int, int]:
    meta = _admin(bootstrap).list_topics(topic, timeout=METADATA_TIMEOUT_S).topics.get(topic)
    if meta is None or meta.error is not None or not meta.partitions:
        why = meta.error if meta is not None and meta.error is not None else "no metadata"
        raise LookupError(f"topic {topic} at {bootstrap}: {why}")
    return {p: pm.leader for p, pm in meta.partitions.items()}


def leader_of(bootstrap: str, topic: str, partition: int) -> int:
    """The node id leading ``topic``/``partition``; -1 while it has no leader."""
    leaders = _partition_leaders(bootstrap, topic)
    if partition not in leaders:
        raise LookupError(f"topic {topic} has no partition {partition} (it has {len(leaders)})")
    return leaders[partition]


def txn_coordinator_of(bootstrap: str, transactional_id: str) -> int:
    """The node id acting as transaction coordinator of ``transactional_id``: the leader of its
    ``__transaction_state`` partition. The topic exists once any transactional producer has
    initialised; before that there is no coordinator (LookupError)."""
    leaders = _partition_leaders(bootstrap, TRANSACTION_STATE_TOPIC)
    return leaders[coordinator_partition(transactional_id, len(leaders))]


def group_coordinator_of(bootstrap: str, group_id: str) -> int:
    """The node id acting as group coordinator of ``group_id``: the leader of its
    ``__consumer_offsets`` partition (the same hash rule as transactional ids)."""
    leaders = _partition_leaders(bootstrap, CONSUMER_OFFSETS_TOPIC)
    return leaders[coordinator_partition(group_id, len(leaders))]


def _stack_bootstrap() -> str:
    from harness import load_stack_env

    return load_stack_env()["TWOPHASE_KAFKA_BOOTSTRAP"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.kafka_nodes", description=__doc__)
    parser.add_argument("--bootstrap", help="default: TWOPHASE_KAFKA_BOOTSTRAP of the stack")
    sub = parser.add_subparsers(dest="what", required=True)
    leader = sub.add_parser("leader", help="node id leading a partition")
    leader.add_argument("topic")
    leader.add_argument("partition", type=int)
    coord = sub.add_parser("txn-coordinator", help="node id coordinating a transactional id")
    coord.add_argument("transactional_id")
    args = parser.parse_args(argv)
    bootstrap = args.bootstrap or _stack_bootstrap()
    if args.what == "leader":
        print(leader_of(bootstrap, args.topic, args.partition))
    else:
        print(txn_coordinator_of(bootstrap, args.transactional_id))
    return 0


if __name__ == "__main__":
    sys.exit(main())
