"""A valid commit run of the pure coordinator and participant machines, with a hook that lets a
test slip any control messages in between every two steps -- what a foreign writer on the
control topic could do. Used by the reader-rule unit tests and the property-based fuzzing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import twophase.coordinator.machine as cm
import twophase.participants.machine as pm
from twophase.protocol.codec import decode, encode, new_envelope
from twophase.protocol.logview import LogView
from twophase.protocol.messages import Envelope, Payload

PIPELINE = "pipe"
KEY = b"test-key"
TP = ("src", 0)
SINKS = ("pg",)

#: Slipped in between two steps: returns envelopes for the participant and the coordinator.
Injector = Callable[[], list[Envelope]]


def wire(payload: Payload, sender: str) -> Envelope:
    """Through the real codec, as the reader gets it."""
    value, headers = encode(new_envelope(PIPELINE, sender, payload), KEY)
    return decode(value, headers, key=KEY, pipeline=PIPELINE)


@dataclass
class Run:
    coord: cm.CoordinatorMachine
    part: pm.ParticipantMachine
    log: list[Envelope] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    #: Highest transaction the real coordinator prepared so far.
    prepared: int = 0
    now: int = 0

    def check(self) -> None:
        """The invariant: no reader's last decided transaction is past a prepared one."""
        assert self.part.log.last_decided <= self.prepared, (self.part.log.last_decided,)
        assert self.coord.log.last_decided <= self.prepared


def _participant_reads(run: Run, env: Envelope) -> None:
    """One message to the participant; its data and apply sides answer at once; what it sends
    is appended to the log."""
    queue: list[pm.Action] = run.part.handle(pm.Received(env))
    while queue:
        a = queue.pop(0)
        if isinstance(a, pm.Skipped):
            run.skipped.append(a.kind)
        elif isinstance(a, pm.PreparePart) and not a.ready:
            queue += run.part.handle(pm.Cut(a.txn))
        elif isinstance(a, pm.PreparePart):
            queue += run.part.handle(pm.PrepareDone(a.txn))
        elif isinstance(a, pm.CommitPart | pm.AbortPart):
            outcome = cm.Outcome.COMMIT if isinstance(a, pm.CommitPart) else cm.Outcome.ABORT
            queue += run.part.handle(pm.PartApplied(a.txn, a.participant, outcome))
        elif isinstance(a, pm.SendVote):
            run.log.append(wire(a.vote, "participant:p"))
        elif isinstance(a, pm.SendApplied):
            run.log.append(wire(a.applied, "participant:p"))


def _coordinator_does(run: Run, actions: list[cm.Action]) -> None:
    """Publish what the coordinator asks for (Published back at once), count its skips."""
    queue = list(actions)
    while queue:
        a = queue.pop(0)
        if isinstance(a, cm.Skipped):
            run.skipped.append(a.kind)
        elif isinstance(a, cm.Publish):
            run.log.append(wire(a.payload, "coordinator:c"))
            if isinstance(a.payload, cm.Prepare):
                run.prepared = max(run.prepared, a.payload.txn)
            queue += run.coord.handle(cm.Published(a.payload, run.now))


def valid_run(cycles: int, inject: Injector = list) -> Run:
    """``cycles`` commit cycles of one record each. Both machines read the one log in order, as
    from the control topic; after every message the real parties wrote, ``inject`` may append
    foreign ones, which both read too."""
    coord = cm.CoordinatorMachine(
        cm.CoordinatorSettings(commit_interval_ms=0, vote_timeout_ms=10**12, checkpoint_every=5)
    )
    coord.handle(cm.SourcePartitions(frozenset({TP}), {TP: 0}))
    coord.handle(cm.LeadershipAcquired(0))
    coord.handle(cm.CaughtUp(0))
    part = pm.ParticipantMachine(pm.ParticipantSettings("p", SINKS))
    part.handle(pm.CaughtUp())
    part.handle(pm.InDoubt(()))
    part.handle(pm.Assigned(1, "p-m", {TP: 0}))
    run = Run(coord, part)
    foreign: set[str] = set()
    read_p = read_c = 0
    for offset in range(cycles):
        run.now += 1
        begin = [a for a in part.handle(pm.WillWrite()) if isinstance(a, pm.BeginPart)]
        txn = begin[0].txn if begin else part.open.txn  # type: ignore[union-attr]
        part.handle(pm.Written(txn, {TP: (offset, 1, 0)}))
        _coordinator_does(run, coord.handle(cm.Tick(run.now)))
        while read_p < len(run.log) or read_c < len(run.log):
            env = run.log[min(read_p, read_c)]
            if read_p <= read_c:
                _participant_reads(run, env)
                read_p += 1
            if read_c < read_p:
                _coordinator_does(run, coord.handle(cm.Received(run.log[read_c], run.now)))
                read_c += 1
            run.check()
            if env.id not in foreign:
                extra = inject()
                foreign.update(e.id for e in extra)
                run.log += extra
    return run


def recover(log: list[Envelope]) -> tuple[cm.CoordinatorMachine, list[str]]:
    """A new coordinator folding ``log``: its machine, and what it refused."""
    coord = cm.CoordinatorMachine(cm.CoordinatorSettings())
    coord.handle(cm.SourcePartitions(frozenset({TP}), {TP: 0}))
    coord.handle(cm.LeadershipAcquired(0))
    refused = [
        a.kind
        for env in log
        for a in coord.handle(cm.Received(env, 0))
        if isinstance(a, cm.Skipped)
    ]
    coord.handle(cm.CaughtUp(0))
    return coord, refused


def fold(log: list[Envelope]) -> LogView:
    view = LogView()
    for env in log:
        view.apply(env)
    return view
