"""The debug switch (ENGINE_DEBUG), and what it guards: values built without their checks
where a transition's own arithmetic already guarantees them (`trusted`, the hot path);
under ENGINE_DEBUG each is rebuilt by its checked constructor and the two must agree."""

from __future__ import annotations

import functools
import os
from typing import Any, TypeVar

import attrs
import numpy as np

# Expensive invariant checks (full scans that transitions already guarantee) run only here.
DEBUG = os.environ.get("ENGINE_DEBUG", "0") not in ("", "0")

T = TypeVar("T", bound=attrs.AttrsInstance)

__all__ = ["DEBUG", "check_trusted", "same_value", "trusted"]


@functools.cache
def _layout(cls: type) -> tuple[frozenset[str], tuple[tuple[str, Any], ...]]:
    """`cls`'s field names, and each field's name with its default (NOTHING: required)."""
    fields = attrs.fields(cls)
    for field in fields:
        if isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
            # Factory is a class at run time; attrs' stubs declare it a function.
            raise TypeError(f"trusted() does not build {cls.__name__}: {field.name} has a factory")
    return frozenset(f.name for f in fields), tuple((f.name, f.default) for f in fields)


def trusted(cls: type[T], /, **values: Any) -> T:
    """A `cls` (a frozen attrs class) with its fields set to `values` as given: no converter,
    validator or `__attrs_post_init__` runs. Every field must be given (fields with a default
    may be left out), by its attribute name, as its converter would leave it (arrays
    read-only). For values a transition made correct by construction. Under ENGINE_DEBUG the
    checked constructor builds the same value too (`check_trusted`)."""
    names, layout = _layout(cls)
    if not values.keys() <= names:
        raise TypeError(f"{cls.__name__} has no fields {sorted(values.keys() - names)}")
    value = object.__new__(cls)
    for name, default in layout:
        field_value = values.get(name, default)
        if field_value is attrs.NOTHING:
            raise TypeError(f"{cls.__name__} needs its field {name}")
        object.__setattr__(value, name, field_value)
    if DEBUG:
        check_trusted(value)
    return value


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
