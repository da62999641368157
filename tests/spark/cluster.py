"""A Spark standalone cluster for the tests: a master and workers on 127.0.0.1, each its own JVM,
started from pyspark's own ``bin/spark-class`` (the wheel ships the standalone daemons).

Executors are processes the workers start, one per worker and application: a job run on
:attr:`StandaloneCluster.url` runs its tasks, and its Python workers, outside the driver's
process, with no state shared but what Spark ships. Ports are ephemeral; logs and the workers'
directories (one per executor, with its stdout and stderr) are under ``base``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType

import pyspark

__all__ = ["StandaloneCluster"]

#: A daemon's JVM start and registration: a few seconds, much longer on a busy 2-core machine
#: (the stack and other JVMs share it).
START_TIMEOUT_S = 120.0
#: A worker stops its executors on SIGTERM; past this the process group is killed.
STOP_TIMEOUT_S = 30.0
_MASTER_URL = re.compile(r"Starting Spark master at (spark://\S+)")


class StandaloneCluster:
    """``with StandaloneCluster(base) as cluster:`` ... ``cluster.url`` (``spark://...``)."""

    def __init__(
        self, base: Path, *, workers: int = 2, worker_cores: int = 1, worker_memory: str = "1g"
    ) -> None:
        self.base = base
        self.workers = workers
        self.worker_cores = worker_cores
        self.worker_memory = worker_memory
        self.url = ""
        self._procs: list[subprocess.Popen[bytes]] = []
        self._spark_class = Path(pyspark.__file__).parent / "bin" / "spark-class"

    # -- life cycle -------------------------------------------------------------------------------

    def __enter__(self) -> StandaloneCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        (self.base / "conf").mkdir(parents=True, exist_ok=True)
        master_log = self.base / "master.log"
        self._spawn(
            master_log,
            "org.apache.spark.deploy.master.Master",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--webui-port",
            "0",
        )
        found = self._wait_for(master_log, _MASTER_URL, "the master")
        self.url = found.group(1)
        self._wait_for(master_log, re.compile(r"New state: ALIVE"), "the master")
        for i in range(self.workers):
            log = self.base / f"worker-{i}.log"
            work = self.base / f"worker-{i}"
            work.mkdir(exist_ok=True)
            self._spawn(
                log,
                "org.apache.spark.deploy.worker.Worker",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                # 0: any free port (the default, 8081, is the schema registry's).
                "--webui-port",
                "0",
                "--cores",
                str(self.worker_cores),
                "--memory",
                self.worker_memory,
                "--work-dir",
                str(work),
                self.url,
            )
        for i in range(self.workers):
            self._wait_for(
                self.base / f"worker-{i}.log",
                re.compile(r"Successfully registered with master"),
                f"worker {i}",
            )

    def stop(self) -> None:
        """Workers first (each stops its executors), then the master; each process group is
        killed when it does not stop in time, so no JVM outlives the test."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in reversed(self._procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            # The group too: an executor a worker left behind goes with it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self._procs.clear()

    # -- what ran ---------------------------------------------------------------------------------

    def executor_dirs(self) -> list[Path]:
        """``worker-N/<app id>/<executor id>``: one per executor process a worker started (the
        worker writes the executor's stdout and stderr there)."""
        return sorted(p for p in self.base.glob("worker-*/app-*/*") if p.is_dir())

    def logs(self) -> str:
        """The daemons' last lines, for a failure message."""
        out = []
        for log in sorted(self.base.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-15:]
            out.append(f"--- {log.name}\n" + "\n".join(lines))
        return "\n".join(out)

    # -- helpers ----------------------------------------------------------------------------------

    def _spawn(self, log: Path, main_class: str, *args: str) -> None:
        env = {
            **os.environ,
            # Each daemon's own heap: they only schedule (the executors get the workers' memory).
            "SPARK_DAEMON_MEMORY": "256m",
            # Never the host name's address: everything here listens on 127.0.0.1.
            "SPARK_LOCAL_IP": "127.0.0.1",
            # An empty configuration directory: no spark-env.sh or spark-defaults.conf of the
            # machine's applies.
            "SPARK_CONF_DIR": str(self.base / "conf"),
        }
        # The executors inherit the workers' environment: no fault injection meant for a driver.
        env.pop("TWOPHASE_CRASH_AT", None)
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [str(self._spark_class), main_class, *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.base,
                start_new_session=True,  # its own process group: stop() kills it whole
            )
        self._procs.append(proc)

    def _wait_for(self, log: Path, pattern: re.Pattern[str], who: str) -> re.Match[str]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            found = pattern.search(log.read_text(errors="replace"))
            if found:
                return found
            if any(p.poll() is not None for p in self._procs):
                raise RuntimeError(f"a Spark daemon exited while waiting for {who}:\n{self.logs()}")
            time.sleep(0.25)
        raise TimeoutError(f"{who} not ready in {START_TIMEOUT_S:.0f}s:\n{self.logs()}")
