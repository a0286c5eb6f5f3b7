"""The camelCase codec of the typed configs: a field's metadata, and dataclass <-> camelCase dict.

A field is declared with `f(json_name, doc, default, **schema)`: its JSON name as users write it, its documentation
and the OpenAPI keywords (bounds, enum, pattern, ...) that both the parser here and the generated CRD
(`h3serve.operator.crd`, from `config/spec.py`) read. Extra, non-schema facts about a field go in `meta`.

No kopf, grpc, av or torch imports here.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import field
from typing import Any


def f(name: str, doc: str, default: Any = dataclasses.MISSING, *, factory: Any = None, meta: dict | None = None,
      **schema: Any) -> Any:
    """A field: its JSON name, its documentation, extra OpenAPI keywords (bounds, enum, ...) and other facts."""
    md = {"json": name, "doc": doc, "schema": schema, **(meta or {})}
    if factory is not None:
        return field(default_factory=factory, metadata=md)
    return field(default=default, metadata=md)


def unwrap_optional(tp):
    """(T, True) for `T | None`, else (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def parse(cls, d: Any, where: str, issues: list) -> Any:
    """A camelCase dict into `cls`; every problem is appended to `issues` as (field, message)."""
    if not isinstance(d, dict):
        issues.append((where, f"{where} must be a mapping, got {type(d).__name__}"))
        return None
    hints = typing.get_type_hints(cls)
    by_json = {fl.metadata["json"]: fl for fl in dataclasses.fields(cls)}
    for k in d:
        if k not in by_json:
            close = [j for j in by_json if j.lower() == str(k).lower() or j.lower().startswith(str(k).lower()[:4])]
            hint = f" (did you mean {close[0]}?)" if close else f"; known fields: {', '.join(sorted(by_json))}"
            issues.append((f"{where}.{k}", f"unknown field {where}.{k}{hint}"))
    kwargs = {}
    for j, fl in by_json.items():
        here = f"{where}.{j}"
        if j not in d or d[j] is None:
            if fl.default is dataclasses.MISSING and fl.default_factory is dataclasses.MISSING:
                issues.append((here, f"{here} is required"))
            continue
        tp, _ = unwrap_optional(hints[fl.name])
        v = d[j]
        if dataclasses.is_dataclass(tp):
            v = parse(tp, v, here, issues)
        elif tp is bool:
            if not isinstance(v, bool):
                issues.append((here, f"{here} must be true or false, got {v!r}"))
        elif tp is int:
            if isinstance(v, bool) or not isinstance(v, int):
                issues.append((here, f"{here} must be an integer, got {v!r}"))
            else:
                lo, hi = fl.metadata["schema"].get("minimum"), fl.metadata["schema"].get("maximum")
                if (lo is not None and v < lo) or (hi is not None and v > hi):
                    issues.append((here, f"{here}={v} must be between {lo} and {hi}"))
        elif tp is str:
            if not isinstance(v, str):
                issues.append((here, f"{here} must be a string, got {v!r}"))
            else:
                enum = fl.metadata["schema"].get("enum")
                if enum and v not in enum:
                    issues.append((here, f"{here}={v!r} must be one of {', '.join(enum)}"))
                pat = fl.metadata["schema"].get("pattern")
                if pat and not re.match(pat, v):
                    issues.append((here, f"{here}={v!r} must match {pat}"))
                ml = fl.metadata["schema"].get("minLength")
                if ml and len(v) < ml:
                    issues.append((here, f"{here} must not be empty"))
        elif tp is dict or typing.get_origin(tp) is dict:
            if not isinstance(v, dict):
                issues.append((here, f"{here} must be a mapping"))
        elif tp is list or typing.get_origin(tp) is list:
            if not isinstance(v, list):
                issues.append((here, f"{here} must be a list"))
        kwargs[fl.name] = v
    if any(i[0].startswith(where) for i in issues):
        try:
            return cls(**kwargs)
        except TypeError:
            return None
    return cls(**kwargs)


def dump(obj: Any) -> Any:
    """A dataclass as its camelCase dict, unset (None) fields left out."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for fl in dataclasses.fields(obj):
            v = getattr(obj, fl.name)
            if v is None:
                continue
            out[fl.metadata["json"]] = dump(v)
        return out
    if isinstance(obj, dict):
        return {k: dump(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [dump(v) for v in obj]
    return obj


def at_path(obj: Any, path: str) -> Any:
    """The value of a typed config at a dotted camelCase path (`dit.levers.residentBlocks`)."""
    for part in path.split("."):
        obj = getattr(obj, next(fl.name for fl in dataclasses.fields(obj) if fl.metadata["json"] == part))
    return obj
