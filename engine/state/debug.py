"""The debug switch (ENGINE_DEBUG), and what it guards: values built without their checks
where a transition's own arithmetic already guarantees them (`trusted`, the hot path);
under ENGINE_DEBUG each is rebuilt by its checked constructor and the two must agree."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import numpy as np

# Expensive invariant checks (full scans that transitions already guarantee) run only here.
DEBUG = os.environ.get("ENGINE_DEBUG", "0") not in ("", "0")

T = TypeVar("T", bound=attrs.AttrsInstance)

__all__ = ["DEBUG", "check_trusted", "same_value", "trusted"]


@functools.cache
def _builder(cls: type) -> Callable[..., Any]:
    """A function that makes a `cls` with its fields set from keyword arguments (attribute
    names; a field with a default may be left out) and runs nothing else: generated once
    per class, as attrs generates `__init__` (a loop over the fields, one lookup each, costs
    more than the stores themselves; `trusted` runs several times a decode step)."""
    fields = attrs.fields(cls)
    defaults: dict[str, Any] = {}
    namespace: dict[str, Any] = {"_cls": cls, "_new": object.__new__, "_set": object.__setattr__}
    namespace["_defaults"] = defaults
    arguments = []
    for field in fields:
        if isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
            # Factory is a class at run time; attrs' stubs declare it a function.
            raise TypeError(f"trusted() does not build {cls.__name__}: {field.name} has a factory")
        if field.name in namespace or field.name == "_value":
            raise TypeError(f"trusted() does not build {cls.__name__}: a field is {field.name}")
        if field.default is attrs.NOTHING:
            arguments.append(field.name)
        else:
            defaults[field.name] = field.default
            arguments.append(f"{field.name}=_defaults[{field.name!r}]")
    lines = [f"def build(*, {', '.join(arguments)}):", "    _value = _new(_cls)"]
    lines += [f"    _set(_value, {field.name!r}, {field.name})" for field in fields]
    lines.append("    return _value")
    exec("\n".join(lines), namespace)  # the names are the fields', checked above
    return namespace["build"]


def trusted(cls: type[T], /, **values: Any) -> T:
    """A `cls` (a frozen attrs class) with its fields set to `values` as given: no converter,
    validator or `__attrs_post_init__` runs. Every field must be given (fields with a default
    may be left out), by its attribute name, as its converter would leave it (arrays
    read-only). For values a transition made correct by construction. Under ENGINE_DEBUG the
    checked constructor builds the same value too (`check_trusted`)."""
    build = _builder(cls)
    try:
        value: T = build(**values)
    except TypeError:
        _check_names(cls, values)  # says which field, where a name is wrong or missing
        raise
    if DEBUG:
        check_trusted(value)
    return value


def _check_names(cls: type, values: dict[str, Any]) -> None:
    """Raise TypeError where `values` names a field `cls` lacks, or leaves out a field that
    has no default."""
    fields = attrs.fields(cls)
    if unknown := values.keys() - {f.name for f in fields}:
        raise TypeError(f"{cls.__name__} has no fields {sorted(unknown)}")
    for field in fields:
        if field.default is attrs.NOTHING and field.name not in values:
            raise TypeError(f"{cls.__name__} needs its field {field.name}")


def check_trusted(value: attrs.AttrsInstance) -> None:
    """Raise AssertionError unless each field of `value` is as its converter would leave it
    and the checked constructor, given the same arguments, makes an equal value (it raises
    its own error where an invariant fails)."""
    cls = type(value)
    fields = attrs.fields(cls)
    for field in fields:
        given = getattr(value, field.name)
        if field.converter is not None and field.converter(given) is not given:
            raise AssertionError(
                f"{cls.__name__}.{field.name} was trusted as given, but its converter changes "
                f"it (a writeable or mistyped array?)"
            )
    checked = cls(**{f.alias: getattr(value, f.name) for f in fields if f.init})
    for field in fields:
        if field.eq and not same_value(getattr(value, field.name), getattr(checked, field.name)):
            raise AssertionError(
                f"trusted {cls.__name__}.{field.name} is {getattr(value, field.name)!r}; the "
                f"checked constructor makes {getattr(checked, field.name)!r}"
            )


def same_value(first: object, second: object) -> bool:
    """Equal values: arrays of one dtype, shape and contents; attrs values field by field
    (also those whose class compares by identity; fields marked eq=False, caches, are not
    compared); anything else by `==`."""
    if first is second:
        return True
    if isinstance(first, np.ndarray) or isinstance(second, np.ndarray):
        return (
            isinstance(first, np.ndarray)
            and isinstance(second, np.ndarray)
            and first.dtype == second.dtype
            and np.array_equal(first, second)
        )
    cls = type(first)
    if attrs.has(cls):
        return cls is type(second) and all(
            same_value(getattr(first, f.name), getattr(second, f.name))
            for f in attrs.fields(cls)
            if f.eq
        )
    return bool(first == second)
