"""Checks that a class implements a `typing.Protocol` in full: every member present,
properties as properties, methods with the same call flavour (awaited, `async for`, or
plain) and the same parameters (names, kinds, defaults). `isinstance` on a
runtime-checkable protocol only checks that the names exist; this checks the shapes."""

from __future__ import annotations

import inspect

ATTRIBUTE = "attribute"  # a data member the protocol declares by annotation only


def protocol_members(protocol: type) -> dict[str, object]:
    """Name -> what `protocol` declares: a function, a property, or ATTRIBUTE."""
    members: dict[str, object] = {
        name: value
        for name, value in vars(protocol).items()
        if (callable(value) or isinstance(value, property)) and not _is_dunder(name)
    }
    members.update(dict.fromkeys(getattr(protocol, "__annotations__", {}), ATTRIBUTE))
    return members


def conformance_errors(cls: type, protocol: type, instance: object = None) -> list[str]:
    """What `cls` lacks or declares differently from `protocol`; empty when it conforms.
    Data attributes are looked up on `instance` (they are usually set in __init__)."""
    errors = []
    for name, declared in protocol_members(protocol).items():
        if declared is ATTRIBUTE:
            holder = cls if instance is None else instance
            if not hasattr(holder, name) and name not in _class_annotations(cls):
                errors.append(f"{cls.__name__} has no attribute {name!r}")
            continue
        found = inspect.getattr_static(cls, name, None)
        errors.extend(_member_errors(cls.__name__, name, declared, found))
    return errors


def _member_errors(owner: str, name: str, declared: object, found: object) -> list[str]:
    if found is None:
        return [f"{owner} has no {name!r}"]
    if isinstance(declared, property):
        return [] if isinstance(found, property) else [f"{owner}.{name} is not a property"]
    if isinstance(found, (staticmethod, classmethod)):
        found = found.__func__
    if not inspect.isfunction(found):
        return [f"{owner}.{name} is not a method"]
    if _flavour(found) != _flavour(declared):
        return [f"{owner}.{name}: {_flavour(found)}, not {_flavour(declared)} as declared"]
    if _parameters(found) != _parameters(declared):
        return [
            f"{owner}.{name}{inspect.signature(found)} differs from {inspect.signature(declared)}"
        ]
    return []


def _flavour(function) -> str:
    """How a method is called: awaited, iterated with `async for`, or plainly."""
    if inspect.iscoroutinefunction(function):
        return "await"
    returns = str(inspect.signature(function).return_annotation)
    if inspect.isasyncgenfunction(function) or "AsyncIterator" in returns:
        return "async for"
    return "call"


def _parameters(function) -> list[tuple]:
    """(name, kind, has a default, the default) of each parameter."""
    return [
        (p.name, p.kind, p.default is not p.empty, p.default)
        for p in inspect.signature(function).parameters.values()
    ]


def _class_annotations(cls: type) -> set[str]:
    return {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {})}


def _is_dunder(name: str) -> bool:
    """Python's and typing's own members (`__init__`, `__subclasshook__`, ...)."""
    return name.startswith("__") and name.endswith("__")
