"""One error root for the product, with the three branches every caller handles.

``RetriableError`` -> retry the call; ``AbortError`` -> abort the transaction and rewind;
``FatalError`` -> stop the process with the message. ``ConfigError`` is fatal and names the field.
"""

from __future__ import annotations

__all__ = [
    "AbortError",
    "ConfigError",
    "FatalError",
    "FencedError",
    "ProtocolError",
    "RetriableError",
    "TwophaseError",
]


class TwophaseError(Exception):
    """Root of every error raised by twophase."""


class RetriableError(TwophaseError):
    """Transient; retrying the same call may succeed. ``retry_after_s``, when set, is how long
    the caller should wait before the next try (a store asking to slow down)."""

    retry_after_s: float | None = None


class AbortError(TwophaseError):
    """The current transaction cannot complete; abort it and rewind to committed positions."""


class FatalError(TwophaseError):
    """Retrying cannot help; the process must stop and say why."""


class ConfigError(FatalError):
    """A configuration value is invalid. The message names the field (and the file)."""

    def __init__(self, field: str, problem: str, *, source: str = "") -> None:
        where = f" in {source}" if source else ""
        super().__init__(f"config field '{field}'{where}: {problem}")
        self.field = field
        self.source = source


class FencedError(FatalError):
    """Another coordinator with the same transactional.id took over; this one must step down."""


class ProtocolError(TwophaseError):
    """A control message that cannot be decoded, authenticated or understood."""
