"""The library's error for a config, spec or option it does not accept."""

from __future__ import annotations


class ConfigError(ValueError):
    """``field`` must be ``allowed`` and ``value`` was given; ``where`` (e.g. the method spec) leads the message when
    known. A ``ValueError``, so callers that catch those keep working."""

    def __init__(self, field: str, allowed: str, value, where: str | None = None):
        self.field, self.allowed, self.value, self.where = field, allowed, value, where
        message = f"{field} must be {allowed}, got {value!r}"
        super().__init__(f"{where}: {message}" if where else message)
