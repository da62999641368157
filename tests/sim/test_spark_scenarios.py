"""Hand-written fault scenarios for the Spark driver on its simulator: each puts one fault at one
exact point of a batch -- every step in turn, for crashes and failing calls -- then drives the
query to quiescence and checks every guarantee."""

from __future__ import annotations

import pytest

from twophase.errors import FencedError
from twophase.participants.spark import machine as sm
from twophase.protocol.messages import Decision, Prepare

from .spark_world import ABORTED, COMMITTED, OPEN, PREPARED, Driver, Params, World

#: The batch the scenarios break (batch 0 before it is committed cleanly).
BATCH = 1
#: Actions a writer carries out by calling Kafka or a store: the ones that can raise.
REQUESTS = (
    sm.Fold,
    sm.Publish,
    sm.ListInDoubt,
    sm.ListStale,
    sm.Resolve,
    sm.RunTasks,
    sm.CommitCheckpoint,
)


def calm(seed: int = 1) -> World:
    # A checkpoint after every decision, so the steps include writing one.
    return World(seed, params=Params.calm(checkpoint_every=1))


def _steps_of_a_clean_batch() -> list[sm.Action]:
    w = calm()
    seen: list[sm.Action] = []

    def record(d: Driver, action: sm.Action) -> None:
        if d.batch == BATCH:
            seen.append(action)

    w.before_action = lambda d, a: record(d, a)
    w.quiesce()
    w.check()
    return seen


STEPS = _steps_of_a_clean_batch()


def test_a_clean_batch_takes_every_kind_of_step() -> None:
    assert set(REQUESTS) - {sm.Fold} <= {type(a) for a in STEPS}
    assert {sm.CrashPoint, sm.Finish} <= {type(a) for a in STEPS}
    published = [type(a.payload) for a in STEPS if isinstance(a, sm.Publish)]
    assert [t.__name__ for t in published] == ["Prepare", "Decision", "Complete", "Checkpoint"]


def _break_at(step: int, fault: str) -> World:
    """A calm world in which the driver's ``step``-th action of the batch is replaced by
    ``fault``: "crash" (the process dies) or "fail" (the call raises; the same writer is called
    again)."""
    w = calm()
    count = [0]
    broken: list[sm.Action] = []

    def maybe_break(d: Driver, action: sm.Action) -> str | None:
        if d.batch != BATCH or broken:
            return None
        count[0] += 1
        if count[0] - 1 != step:
            return None
        broken.append(action)
        return fault

    w.before_action = maybe_break
    w.quiesce()
    w.check()
    assert broken == [STEPS[step]], f"step {step} never came"
    return w


@pytest.mark.parametrize("step", range(len(STEPS)))
def test_a_driver_killed_before_any_step_of_a_batch_loses_and_doubles_nothing(step: int) -> None:
    w = _break_at(step, "crash")
    assert len(w.drivers) == 2, "the query restarted in a new process"


@pytest.mark.parametrize("step", [i for i, a in enumerate(STEPS) if isinstance(a, REQUESTS)])
def test_a_call_that_fails_at_any_request_is_repaired_by_the_next_call(step: int) -> None:
    w = _break_at(step, "fail")
    assert len(w.drivers) == 1, "the same writer was called again"


def _zombie_mid_tasks(seed: int) -> tuple[World, Driver, Driver]:
    """Batch 1's tasks are running when a second driver of the pipeline starts."""
    w = calm(seed)
    w.run_until(lambda: w.live.batch == BATCH and w.live.job is not None)
    zombie = w.live
    w.start_zombie()
    zombie.zombie_calls = 0
    return w, zombie, w.live


def _tag(w: World, d: Driver, txn: int) -> int:
    """The offset of ``d``'s PREPARE of ``txn``: its attempt's tag."""
    return next(
        offset
        for offset, (epoch, env) in enumerate(w.log)
        if epoch == d.epoch and isinstance(env.payload, Prepare) and env.payload.txn == txn
    )


def test_a_zombie_cannot_decide_and_aborts_its_own_parts() -> None:
    w, zombie, live = _zombie_mid_tasks(seed=3)
    w.held = [live]
    w.run_until(lambda: not zombie.in_call)
    assert isinstance(zombie.errors[-1], FencedError), zombie.errors
    assert "fenced while writing Decision" in str(zombie.errors[-1])
    assert not [
        env
        for _, env in w.log
        if isinstance(env.payload, Decision) and env.payload.txn == BATCH + 1
    ], "the zombie decided"
    tag = _tag(w, zombie, BATCH + 1)
    parts = [(s, pid) for s in w.stores.values() for pid in s.parts if sm.tag_of(pid) == tag]
    assert parts and all(s.parts[pid].state == ABORTED for s, pid in parts)
    w.quiesce()
    w.check()


def test_parts_a_zombie_prepares_after_the_new_driver_looked_are_aborted_by_its_next_batch() -> (
    None
):
    w, zombie, live = _zombie_mid_tasks(seed=5)
    # The new driver opens batch 1 and resolves in-doubt parts before the zombie's tasks
    # prepare; the zombie then dies at its decision, before it could abort them itself.
    w.held = [zombie]
    w.run_until(lambda: live.job is not None)
    w.held = [live]
    w.before_action = lambda d, a: "crash" if d is zombie and isinstance(a, sm.Publish) else None
    w.run_until(lambda: not zombie.alive)
    tag = _tag(w, zombie, BATCH + 1)
    left = [
        (s, pid)
        for s in w.stores.values()
        for pid, sp in s.parts.items()
        if sp.state == PREPARED and sm.tag_of(pid) == tag
    ]
    assert left, "the zombie's tasks prepared nothing"
    w.held = []
    w.run_until(lambda: w.spark_committed == BATCH + 1)  # the new driver's next batch
    assert all(s.parts[pid].state == ABORTED for s, pid in left)
    w.quiesce()
    w.check()


def test_a_decision_that_landed_though_its_write_failed_is_applied_by_the_replay() -> None:
    w = calm(7)
    failed: list[int] = []

    def after_decision(d: Driver, action: sm.Action) -> str | None:
        # The DECISION is in the log; the writer saw its write fail (an unknown outcome).
        if not failed and action == sm.CrashPoint("spark_after_decision"):
            failed.append(d.batch)
            return "fail"
        return None

    w.before_action = after_decision
    w.quiesce()
    w.check()
    assert failed == [0]
    prepares = [env.payload.txn for _, env in w.log if isinstance(env.payload, Prepare)]
    assert prepares.count(1) == 1, "the replay of batch 0 wrote nothing new"
    assert all(sp.state == COMMITTED for s in w.stores.values() for sp in s.parts.values())


def test_parts_left_open_by_a_killed_driver_s_tasks_are_aborted_by_the_next_attempt() -> None:
    w = calm(11)
    prepare_steps = len(w.stores)
    # Some task has begun its part in a sink, and prepared it nowhere yet.
    w.run_until(
        lambda: (
            w.live.batch == BATCH and any(t.begun and len(t.steps) > prepare_steps for t in w.tasks)
        )
    )
    killed = w.live
    opened = [(w.stores[s], t.part) for t in w.tasks if t.job.driver is killed for s in t.begun]
    w.crash(killed)
    # A marker outlives its writer (MongoDB, files); PostgreSQL rolled its part back.
    left = [(s, pid) for s, pid in opened if pid in s.parts]
    assert left and all(s.parts[pid].state == OPEN and s.name != "pg" for s, pid in left)
    w.quiesce()
    w.check()
    assert all(s.parts[pid].state == ABORTED for s, pid in left)
