"""Method specs: the one text form of a method config, shared by the CLI, eval, the benches and the Python API.

A spec is ``NAME`` or ``NAME:FIELD=VALUE,FIELD=VALUE`` (e.g. ``quest:per_query_head=false,dense_layers=0``);
``--opt FIELD=VALUE`` adds one field the same way. Each value is read by the type of its config field:
booleans take true/false (also yes/no, on/off, 1/0), numbers are numbers, a budget with a decimal point or an
exponent is a fraction (``0.1``), an optional field takes ``none``, and a tuple of layer indices is written
``[2,8,18]``. Anything else is refused with a ``ConfigError`` naming the field and what it allows.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable

from .methods import METHODS
from .errors import ConfigError
from .methods.base import MethodConfig

BOOLEANS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def parse_budget(text: str) -> int | float:
    """A token count (``2048``) or, with a decimal point or an exponent, a fraction of the prompt (``0.1``)."""
    try:
        return float(text) if "." in text or "e" in text.lower() else int(text)
    except ValueError:
        raise ConfigError("token_budget", "a number of tokens (e.g. 2048) or a fraction (e.g. 0.1)", text) from None


def budget_arg(text: str) -> int | float:
    """``parse_budget`` for argparse's ``type=``: a bad value becomes a usage error that says what is allowed."""
    try:
        return parse_budget(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _split_top_level(text: str) -> list[str]:
    """``text`` cut at the commas outside brackets: ``"a=1,b=[2,3]"`` -> ``["a=1", "b=[2,3]"]``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def parse_spec(spec: str) -> tuple[str, list[str]]:
    """``"quest:dense_layers=0,per_query_head=true"`` -> ``("quest", ["dense_layers=0", "per_query_head=true"])``;
    the method name is checked."""
    name, _, rest = spec.strip().partition(":")
    if name not in METHODS:
        raise ConfigError("method", f"one of {', '.join(METHODS)} (optionally NAME:FIELD=VALUE,...)", name)
    return name, _split_top_level(rest)


def _parse_value(raw: str, kind, field: str):
    """``raw`` read as a value of the annotation ``kind`` of config field ``field``."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) < len(args) and raw.lower() == "none":
            return None
        optional = " or none" if len(members) < len(args) else ""
        if set(members) == {int, float}:
            try:
                return parse_budget(raw)
            except ConfigError:
                raise ConfigError(field, f"an integer or a fraction such as 0.1{optional}", raw) from None
        if len(members) == 1:
            try:
                return _parse_value(raw, members[0], field)
            except ConfigError as err:
                raise ConfigError(field, err.allowed + optional, raw) from None
    if kind is bool:
        if raw.lower() not in BOOLEANS:
            raise ConfigError(field, "true or false", raw)
        return BOOLEANS[raw.lower()]
    if kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            raise ConfigError(field, "an integer" if kind is int else "a number", raw) from None
    if kind is str:
        return raw
    if typing.get_origin(kind) is tuple and args[-1] is Ellipsis:
        inner = raw.strip()
        if inner[:1] in "[(" and inner[-1:] in "])":
            inner = inner[1:-1]
        try:
            return tuple(_parse_value(item, args[0], field) for item in _split_top_level(inner))
        except ConfigError:
            raise ConfigError(field, f"a list of {args[0].__name__} such as [2,8,18]", raw) from None
    raise ConfigError(field, f"set from Python (its type {kind} has no text form)", raw)


def build_config(spec: str, budget: int | float | None = None, options: Iterable[str] = ()) -> MethodConfig:
    """The config of method spec ``spec`` with ``options`` (``FIELD=VALUE`` items, e.g. from ``--opt``) and
    ``token_budget=budget`` (None: the spec's or the method's default). A field given twice, an unknown field,
    a budget for a method without one and any value the config refuses raise ``ConfigError``."""
    name, items = parse_spec(spec)
    cls = METHODS[name]
    kinds = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    values: dict = {}
    for item in [*items, *options]:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or key not in fields:
            raise ConfigError("method field", f"FIELD=VALUE with a field of {name} ({', '.join(fields)})", item,
                              where=spec)
        if key in values:
            raise ConfigError(key, "given once", item, where=spec)
        try:
            values[key] = _parse_value(raw.strip(), kinds[key], key)
        except ConfigError as err:
            raise ConfigError(err.field, err.allowed, err.value, where=spec) from None
    if budget is not None:
        if "token_budget" not in fields:
            raise ConfigError("token_budget", f"unset: method {name} takes no budget", budget, where=spec)
        if "token_budget" in values:
            raise ConfigError("token_budget", "given once (by the budget or in the spec)", budget, where=spec)
        values["token_budget"] = budget
    try:
        return cls(**values)
    except ConfigError as err:
        raise ConfigError(err.field, err.allowed, err.value, where=spec) from None


def takes_budget(spec: str, options: Iterable[str] = ()) -> bool:
    """Whether the spec's method has a ``token_budget`` that neither the spec nor ``options`` set."""
    name, items = parse_spec(spec)
    return "token_budget" in METHODS[name].__dataclass_fields__ and not any(
        item.partition("=")[0].strip() == "token_budget" for item in [*items, *options])
