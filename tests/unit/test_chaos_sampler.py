"""The soak's leak check on real processes: one that keeps allocating memory and opening files
is called a leak, one that holds steady after warming up is not, and a process too short-lived
to judge is counted but not judged."""

from __future__ import annotations

import subprocess
import sys
import time

from chaos.sampler import Sampler

# Warms up (allocates 40 MB once), then either stays put or, with "leak", adds 6 MB and 4 open
# files every 0.1 s.
CHILD = """
import sys, time
hold = [b"x" * (40 << 20)]
files = []
leak = sys.argv[1] == "leak"
while True:
    time.sleep(0.1)
    if leak:
        hold.append(b"x" * (6 << 20))
        for _ in range(4):
            files.append(open("/dev/null"))
"""


def _run(kind: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", CHILD, kind])


def test_a_growing_process_is_a_leak_and_a_steady_one_is_not() -> None:
    leak, steady = _run("leak"), _run("steady")
    short = _run("steady")
    procs = {"leaky": leak.pid, "steady": steady.pid, "short": short.pid}
    sampler = Sampler(lambda: procs, interval_s=0.1)
    try:
        sampler.start()
        time.sleep(1.0)
        short.kill()
        short.wait()
        time.sleep(3.0)
    finally:
        sampler.stop()
        for p in (leak, steady):
            p.kill()
            p.wait()
    report = sampler.report(min_span_s=2.5)
    judged = {v["name"]: v for v in report["judged"]}
    assert set(judged) == {"leaky", "steady"}
    assert report["not_judged"] == 1
    assert judged["leaky"]["grows"] == ["rss_mb", "fds"]
    assert judged["steady"]["grows"] == []
    assert report["leaks"] == [f"leaky (pid {leak.pid}): rss_mb, fds"]
    assert judged["steady"]["rss_mb"]["last_quarter_median"] >= 40
