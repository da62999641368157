"""A small client of Toxiproxy's HTTP API (``stack/toxiproxy.sh`` builds and starts the server).

A *proxy* listens on one port and forwards to another; *toxics* degrade it (``latency``,
``bandwidth``, ``reset_peer``, ``timeout``, ...) and disabling it is a full partition: open
connections are closed and new ones refused until it is enabled again. Only what the chaos run
uses is here; the API itself is documented with Toxiproxy (v2.5.0).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "stack" / "toxiproxy.sh"

#: The API answers in milliseconds on a local server; this only bounds a stuck one.
API_TIMEOUT_S = 10.0


class ToxiproxyError(RuntimeError):
    pass


class Toxiproxy:
    """The API of one server on ``127.0.0.1:port``."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.url = f"http://{host}:{port}"

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=API_TIMEOUT_S) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace").strip()
            raise ToxiproxyError(f"{method} {path}: HTTP {exc.code} {detail}") from None
        except OSError as exc:
            raise ToxiproxyError(f"{method} {path}: {exc}") from None
        return json.loads(raw) if raw.strip() else None

    def version(self) -> str:
        req = urllib.request.Request(self.url + "/version")
        with urllib.request.urlopen(req, timeout=API_TIMEOUT_S) as resp:
            return str(resp.read().decode().strip())

    def proxies(self) -> dict[str, Any]:
        return dict(self._call("GET", "/proxies"))

    def create(self, name: str, listen: str, upstream: str) -> None:
        """A proxy ``name`` on ``listen`` (``host:port``) forwarding to ``upstream``."""
        self._call(
            "POST",
            "/proxies",
            {"name": name, "listen": listen, "upstream": upstream, "enabled": True},
        )

    def delete(self, name: str) -> None:
        self._call("DELETE", f"/proxies/{name}")

    def set_enabled(self, name: str, enabled: bool) -> None:
        """Disabled: every connection through the proxy is closed and new ones are refused."""
        self._call("POST", f"/proxies/{name}", {"enabled": enabled})

    def add_toxic(
        self,
        proxy: str,
        kind: str,
        attributes: dict[str, Any],
        *,
        name: str | None = None,
        stream: str = "downstream",
        toxicity: float = 1.0,
    ) -> str:
        """Add a toxic (``latency``, ``bandwidth``, ``reset_peer``, ...); returns its name."""
        toxic = name or f"{kind}_{stream}"
        self._call(
            "POST",
            f"/proxies/{proxy}/toxics",
            {
                "name": toxic,
                "type": kind,
                "stream": stream,
                "toxicity": toxicity,
                "attributes": attributes,
            },
        )
        return toxic

    def remove_toxic(self, proxy: str, toxic: str) -> None:
        self._call("DELETE", f"/proxies/{proxy}/toxics/{toxic}")

    def toxics(self, proxy: str) -> list[dict[str, Any]]:
        return list(self._call("GET", f"/proxies/{proxy}/toxics"))

    def heal(self, proxy: str) -> None:
        """Back to a clean pipe: every toxic removed, the proxy enabled."""
        for t in self.toxics(proxy):
            self.remove_toxic(proxy, str(t["name"]))
        self.set_enabled(proxy, True)

    def reset(self) -> None:
        """Every proxy enabled and without toxics (``POST /reset``)."""
        self._call("POST", "/reset")


class ToxiproxyServer:
    """A server started and stopped through ``stack/toxiproxy.sh`` (built on first use)."""

    def __init__(self, port: int, workdir: Path) -> None:
        self.port, self.workdir = port, workdir
        self.api = Toxiproxy(port)

    def start(self) -> Toxiproxy:
        out = subprocess.run(
            ["bash", str(SCRIPT), "start", str(self.port), str(self.workdir)],
            capture_output=True,
            text=True,
            # A cold build from the Go module proxy takes ~40 s on this machine.
            timeout=600,
        )
        if out.returncode != 0:
            raise ToxiproxyError(f"stack/toxiproxy.sh start failed: {out.stderr.strip()[-2000:]}")
        deadline = time.monotonic() + 10
        while True:
            try:
                self.api.version()
                return self.api
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        subprocess.run(
            ["bash", str(SCRIPT), "stop", str(self.workdir)],
            capture_output=True,
            text=True,
            timeout=30,
        )
