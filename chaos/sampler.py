"""Resident memory and open file descriptors of a run's processes, sampled over time, and the
verdict whether any of them grows (a leak) -- the soak's check (``chaos/README.md``).

A process is followed per *incarnation* (name and pid): a killed and restarted participant is a
new series, since its memory starts over. An incarnation is judged only when it lived long
enough to say anything (``min_span_s``); its first quarter is warm-up (imports, caches, the first
parts) and is left out; it *grows* when the median of its last quarter is above the median of
its second quarter by more than both bounds of a resource (relative and absolute): RSS by 20%
and 32 MB, descriptors by 20% and 16. Medians, not maxima, so one busy moment is no leak.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Growth that makes a leak, per resource: (relative, absolute).
RSS_GROWTH = (0.20, 32.0)  # MB
FD_GROWTH = (0.20, 16.0)


def rss_mb(pid: int) -> float | None:
    """VmRSS of ``pid`` in MB; None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def open_fds(pid: int) -> int | None:
    """How many descriptors ``pid`` holds open; None when it is gone (or not ours to read)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


@dataclass
class Series:
    """One incarnation's samples: (seconds since the sampler started, RSS MB, fds)."""

    name: str
    pid: int
    samples: list[tuple[float, float, int]] = field(default_factory=list)

    def verdict(self, min_span_s: float) -> dict[str, Any] | None:
        """Its figures and whether it grew; None when it lived too briefly to judge."""
        if len(self.samples) < 8 or self.samples[-1][0] - self.samples[0][0] < min_span_s:
            return None
        q = len(self.samples) // 4
        early, late = self.samples[q : 2 * q], self.samples[-q:]
        out: dict[str, Any] = {
            "name": self.name,
            "pid": self.pid,
            "span_s": round(self.samples[-1][0] - self.samples[0][0]),
            "samples": len(self.samples),
            "grows": [],
        }
        for label, index, (rel, absolute) in (("rss_mb", 1, RSS_GROWTH), ("fds", 2, FD_GROWTH)):
            before = statistics.median(s[index] for s in early)
            after = statistics.median(s[index] for s in late)
            tenth = max(1, len(self.samples) // 10)
            out[label] = {
                "second_quarter_median": round(before, 1),
                "last_quarter_median": round(after, 1),
                "max": round(max(s[index] for s in self.samples), 1),
                # The shape: a leak climbs to the end, a high-water mark levels off.
                "tenths_median": [
                    round(statistics.median(x[index] for x in self.samples[i : i + tenth]), 1)
                    for i in range(0, tenth * 10, tenth)
                ],
            }
            if after - before > absolute and after > before * (1 + rel):
                out["grows"].append(label)
        return out


class Sampler(threading.Thread):
    """Every ``interval_s``, the RSS and descriptors of each process ``pids()`` names (name ->
    pid; a name may come and go as processes die and restart)."""

    def __init__(self, pids: Callable[[], Mapping[str, int]], interval_s: float = 5.0) -> None:
        super().__init__(name="sampler", daemon=True)
        self._pids = pids
        self._interval = interval_s
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._series: dict[tuple[str, int], Series] = {}
        self._t0 = time.monotonic()
        self.errors = 0
        self.last_error = ""

    def run(self) -> None:
        while not self._done.is_set():
            try:
                self.sample()
            except Exception as exc:  # noqa: BLE001 -- a missed sample, not a silent end
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
            self._done.wait(self._interval)

    def sample(self) -> None:
        now = time.monotonic() - self._t0
        for name, pid in dict(self._pids()).items():
            rss, fds = rss_mb(pid), open_fds(pid)
            if rss is None or fds is None:
                continue
            with self._lock:
                series = self._series.setdefault((name, pid), Series(name, pid))
                series.samples.append((now, rss, fds))

    def stop(self) -> None:
        self._done.set()
        if self.is_alive():
            self.join(timeout=self._interval + 5)

    def report(self, min_span_s: float) -> dict[str, Any]:
        """Per judged incarnation its figures; ``leaks``: those that grew; ``not_judged``:
        incarnations that lived less than ``min_span_s`` (killed and restarted)."""
        with self._lock:
            series = list(self._series.values())
        judged = [v for s in series if (v := s.verdict(min_span_s)) is not None]
        peaks: dict[str, dict[str, float]] = {}
        for s in series:
            peak = peaks.setdefault(s.name, {"rss_mb": 0.0, "fds": 0, "incarnations": 0})
            peak["rss_mb"] = round(max(peak["rss_mb"], *(x[1] for x in s.samples)), 1)
            peak["fds"] = max(peak["fds"], *(x[2] for x in s.samples))
            peak["incarnations"] += 1
        return {
            "interval_s": self._interval,
            "min_span_s": min_span_s,
            "sample_errors": self.errors,
            "last_sample_error": self.last_error,
            "peaks": dict(sorted(peaks.items())),
            "judged": judged,
            "not_judged": len(series) - len(judged),
            "leaks": [
                f"{v['name']} (pid {v['pid']}): {', '.join(v['grows'])}"
                for v in judged
                if v["grows"]
            ],
        }
