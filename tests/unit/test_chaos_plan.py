"""The chaos run's fault plans: a full run on three brokers kills the two broker roles that
matter (the control partition's leader, the transaction coordinator) instead of "the" broker,
a full run spreads the store faults between the others, and a soak draws every kind of
fault, only the ones the stack can take."""

from __future__ import annotations

import itertools

from chaos.run import make_plan, soak_episodes


def _stacks(plan: list) -> list[str]:
    return [e.stack for e in plan if e.stack]


def test_one_broker_restarts_kafka_and_pg_once_each() -> None:
    assert _stacks(make_plan(52, 3, False, 10)) == ["kafka", "pg"]


def test_three_brokers_kill_the_control_leader_and_the_txn_coordinator() -> None:
    plan = make_plan(52, 3, False, 10, brokers=3)
    assert _stacks(plan) == ["kafka-control-leader", "kafka-txn-coordinator", "pg"]
    assert sum(len(e.faults) for e in plan) >= 52
    assert sum(1 for e in plan if e.net) == 10


def test_a_soak_draws_every_kind_and_only_what_the_stack_has() -> None:
    eps = list(itertools.islice(soak_episodes(5, 1, kafka_net=True, net=True), 400))
    assert {e.stack for e in eps if e.stack} == {"kafka", "pg"}
    services = {e.net.service for e in eps if e.net}
    assert services == {"kafka", "pg", "mongo"}
    kills = [e for e in eps if e.faults]
    assert len(kills) > len(eps) * 0.4
    assert {e.store.kind for e in eps if e.store} == {"pg_terminate", "pg_connlimit", "disk_full"}
    assert {f.role for e in kills for f in e.faults} >= {"participant", "leader", "standby"}

    quiet = list(itertools.islice(soak_episodes(5, 3, kafka_net=False, net=True, mongo=False), 400))
    assert {e.net.service for e in quiet if e.net} == {"pg"}
    assert {e.stack for e in quiet if e.stack} == {
        "kafka-control-leader",
        "kafka-txn-coordinator",
        "pg",
    }
    no_net = list(itertools.islice(soak_episodes(5, 1, kafka_net=False, net=False), 200))
    assert not any(e.net for e in no_net)
    no_disk = list(itertools.islice(soak_episodes(5, 1, True, True, disk=False), 400))
    assert {e.store.kind for e in no_disk if e.store} == {"pg_terminate", "pg_connlimit"}


def test_a_full_run_has_each_store_fault_once_between_the_others() -> None:
    plan = make_plan(52, 3, False, 10, store_faults=3)
    stores = [i for i, e in enumerate(plan) if e.store]
    assert [plan[i].store.kind for i in stores] == ["pg_terminate", "disk_full", "pg_connlimit"]
    # Spread through the run, never first or last, never two store faults in a row.
    assert stores[0] > 0 and stores[-1] < len(plan) - 1
    assert all(b - a > 1 for a, b in itertools.pairwise(stores))
    assert sum(1 for e in plan if e.net) == 10
    assert sum(len(e.faults) for e in plan) >= 52
    # Where the files sink cannot have a disk of its own, no full disk is planned.
    no_disk = make_plan(52, 3, False, 10, store_faults=3, disk=False)
    assert [e.store.kind for e in no_disk if e.store] == [
        "pg_terminate",
        "pg_connlimit",
        "pg_terminate",
    ]
    assert not any(e.store for e in make_plan(4, 3, True, 2, store_faults=3))
