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


def test_the_proxies_refuse_a_stack_port_inside_their_range(tmp_path) -> None:
    """Every proxy and the API port are checked against the stores' own ports, for each kind
    of proxy (PostgreSQL's port where a MongoDB proxy listens, and the reverse) and on three
    brokers; ports outside the range pass."""
    from chaos.run import NET_PORT_OFFSET, NET_PROCESSES, Net, net_port
    from harness import Scenario

    def net(pg: int, mongo: int, brokers: int = 1) -> Net:
        s = Scenario(
            "c",
            "127.0.0.1:19092",
            f"postgresql://u:p@127.0.0.1:{pg}/d",
            f"mongodb://127.0.0.1:{mongo}/?replicaSet=r",
            tmp_path,
        )
        return Net(s, 19092, kafka=False, brokers=brokers)

    base = 19092 + NET_PORT_OFFSET
    assert net(19532, 19018).clash() is None
    assert net(19532, 19018, brokers=3).clash() is None
    for service in ("kafka", "pg", "mongo"):
        for n in NET_PROCESSES:
            taken = net_port(base, service, n)
            why = net(taken, 19018).clash()
            assert why is not None and f"PostgreSQL's port {taken}" in why
            assert f"{n}'s {service} proxy" in why
            assert net(19532, taken).clash() is not None
    assert "Toxiproxy API" in (net(base, 19018).clash() or "")
    assert net(19532, net_port(base, "kafka", "p-2") + 200, brokers=3).clash() is not None
    assert net(19532, net_port(base, "kafka", "p-2") + 200).clash() is None
