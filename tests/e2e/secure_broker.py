"""A private single-node Kafka broker with a SASL_SSL (SASL/PLAIN) listener, for the security tests.

It runs the jars the local stack uses (``TWOPHASE_KAFKA_JARS_DIR`` in ``stack.env``) in its own
data directory on free ports, with a throw-away CA made by ``openssl``: the broker reads a
PKCS12 keystore, clients trust the CA in PEM form (librdkafka's ``ssl.ca.location``).
:meth:`SecureBroker.stop` kills the process it started and removes the directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SecureBroker", "free_port"]

REPO = Path(__file__).resolve().parents[2]
#: A JVM broker formats and starts in ~10 s on the 2-core test machine; three times that
#: leaves room for a machine busy with other tests.
START_TIMEOUT_S = 60.0
#: Credentials of the broker's own inter-broker connection and of the client the tests use.
ADMIN_USER, ADMIN_PASSWORD = "admin", "admin-pw-4c1e9b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(args: list[str], cwd: Path) -> None:
    subprocess.run(args, cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_certs(d: Path) -> None:
    """CA, and a server certificate for 127.0.0.1/localhost signed by it, in PKCS12."""
    _run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=twophase-test-ca", "-keyout", "ca.key", "-out", "ca.pem"],
        d,
    )  # fmt: skip
    _run(
        ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
         "-keyout", "server.key", "-out", "server.csr"],
        d,
    )  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _run(
        ["openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "server.pem"],
        d,
    )  # fmt: skip
    _run(
        ["openssl", "pkcs12", "-export", "-in", "server.pem", "-inkey", "server.key",
         "-certfile", "ca.pem", "-name", "broker", "-passout", "pass:keystore-pw",
         "-out", "server.p12"],
        d,
    )  # fmt: skip


@dataclass
class SecureBroker:
    """``users`` maps SASL/PLAIN user names to passwords the broker accepts."""

    users: dict[str, str]
    jars_dir: Path
    root: Path = Path()
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ca_location(self) -> str:
        return str(self.root / "ca.pem")

    @property
    def log_path(self) -> Path:
        return self.root / "broker.log"

    def client_config(self, user: str, password: str) -> dict[str, Any]:
        """librdkafka settings of a client of this broker."""
        return {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "PLAIN",
            "sasl.username": user,
            "sasl.password": password,
            "ssl.ca.location": self.ca_location,
        }

    def admin_config(self) -> dict[str, Any]:
        return {
            "bootstrap.servers": self.bootstrap,
            **self.client_config(ADMIN_USER, ADMIN_PASSWORD),
        }

    def _java(self, *args: str) -> list[str]:
        return [
            "java", "-Xms128m", "-Xmx256m", "-XX:+UseSerialGC", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={REPO / 'stack' / 'kafka' / 'log4j2.properties'}",
            "-cp", f"{self.jars_dir}/*", *args,
        ]  # fmt: skip

    def _properties(self, controller_port: int) -> str:
        users = {ADMIN_USER: ADMIN_PASSWORD, **self.users}
        jaas = (
            "org.apache.kafka.common.security.plain.PlainLoginModule required "
            f'username="{ADMIN_USER}" password="{ADMIN_PASSWORD}" '
            + " ".join(f'user_{u}="{p}"' for u, p in users.items())
            + ";"
        )
        return "\n".join(
            [
                "process.roles=broker,controller",
                "node.id=1",
                f"controller.quorum.voters=1@127.0.0.1:{controller_port}",
                "controller.listener.names=CONTROLLER",
                f"listeners=SASL_SSL://127.0.0.1:{self.port},"
                f"CONTROLLER://127.0.0.1:{controller_port}",
                f"advertised.listeners=SASL_SSL://127.0.0.1:{self.port}",
                "listener.security.protocol.map=SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT",
                # The broker talks to itself through the secured listener too.
                "inter.broker.listener.name=SASL_SSL",
                "sasl.mechanism.inter.broker.protocol=PLAIN",
                "sasl.enabled.mechanisms=PLAIN",
                f"listener.name.sasl_ssl.plain.sasl.jaas.config={jaas}",
                f"ssl.keystore.location={self.root / 'server.p12'}",
                "ssl.keystore.type=PKCS12",
                "ssl.keystore.password=keystore-pw",
                "ssl.key.password=keystore-pw",
                f"ssl.truststore.location={self.root / 'ca.pem'}",
                "ssl.truststore.type=PEM",
                "ssl.endpoint.identification.algorithm=",
                f"log.dirs={self.root / 'data'}",
                "num.partitions=1",
                "auto.create.topics.enable=false",
                "offsets.topic.replication.factor=1",
                "offsets.topic.num.partitions=4",
                "transaction.state.log.replication.factor=1",
                "transaction.state.log.min.isr=1",
                "transaction.state.log.num.partitions=4",
                "min.insync.replicas=1",
                "group.initial.rebalance.delay.ms=0",
                "group.min.session.timeout.ms=1000",
                "",
            ]
        )

    def start(self) -> SecureBroker:
        self.root = Path(tempfile.mkdtemp(prefix="twophase-secure-kafka-"))
        _make_certs(self.root)
        self.port = free_port()
        controller_port = free_port()
        props = self.root / "server.properties"
        props.write_text(self._properties(controller_port))
        cluster_id = subprocess.run(
            self._java("kafka.tools.StorageTool", "random-uuid"),
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split()[-1]
        subprocess.run(
            self._java(
                "kafka.tools.StorageTool", "format", "--cluster-id", cluster_id,
                "--config", str(props),
            ),
            check=True,
            capture_output=True,
            timeout=60,
        )  # fmt: skip
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self._java("kafka.Kafka", str(props)),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"secure broker exited:\n{self.tail()}")
            if "Kafka Server started" in self.log_path.read_text(errors="replace"):
                return self
            time.sleep(0.3)
        raise TimeoutError(f"secure broker not started in {START_TIMEOUT_S}s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # Its own session: the JVM and nothing else.
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        if self.root != Path() and self.root.exists():
            shutil.rmtree(self.root, ignore_errors=True)
