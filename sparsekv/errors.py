"""The library's error for a config, spec or option it does not accept."""

from __future__ import annotations


SHOWN_CHARS = 200  # of a value echoed in an error message: a client's megabyte of input is not sent back


def shown(value) -> str:
    """``value`` for an error message: a list or tuple of more than 8 items as its count and first 8, anything else
    as its ``repr`` cut to about ``SHOWN_CHARS`` characters with the full length said."""
    long = isinstance(value, (list, tuple)) and len(value) > 8
    text = f"{type(value).__name__} of {len(value)} items starting {list(value[:8])!r}" if long else repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS - 40]}... ({len(text)} characters)"


class ConfigError(ValueError):
    """``field`` must be ``allowed`` and ``value`` was given; ``where`` (e.g. the method spec) leads the message when
    known. A ``ValueError``, so callers that catch those keep working."""

    def __init__(self, field: str, allowed: str, value, where: str | None = None):
        self.field, self.allowed, self.value, self.where = field, allowed, value, where
        message = f"{field} must be {allowed}, got {shown(value)}"
        super().__init__(f"{where}: {message}" if where else message)
