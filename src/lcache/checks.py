"""Checks of arguments the library takes: a bad value is a ConfigError that names it."""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
import os
import unicodedata
from typing import Any

import numpy as np

from lcache.errors import ConfigError


def whole_number(value: Any, name: str, low: int, high: int | None = None) -> int:
    """``value`` as an int in [low, high] (ints and numpy integers; not bools, floats or
    strings), or a ConfigError naming ``name``."""
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if number is None or isinstance(value, bool) or number < low or \
            (high is not None and number > high):
        span = f"from {low:,} to {high:,}" if high is not None else f"of at least {low}"
        raise ConfigError(f"{name}={value!r}: give a whole number {span}")
    return number


def real_number(value: Any, name: str, low: float, high: float) -> float:
    """``value`` as a float in [low, high] (ints, floats and numpy numbers; not bools,
    strings or NaN), or a ConfigError naming ``name``."""
    number = math.nan  # in no range
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        try:
            number = float(value)
        except OverflowError:  # an int past float's range
            number = math.inf
    if not low <= number <= high:
        raise ConfigError(f"{name}={value!r:.200}: give a number from {low:g} to {high:g}")
    return number


def seconds(value: Any, name: str) -> float:
    """``value`` as a duration in seconds: an int or float >= 0 (``inf`` allowed; not NaN,
    bools or strings), or a ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"{name}={value!r:.200}: give seconds (a number >= 0)")
    return float(value)


def text_argument(value: Any, name: str) -> str | None:
    """``value`` as a label (a str, an int made a str: a version number) or None, or a
    ConfigError naming ``name``: what is stored in JSON and compared on the next open must
    read back equal, and a label is printed in messages, so it holds no NUL, control or
    format character (see ``unshowable``)."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise ConfigError(f"{name}={value!r:.200}: give a string (or None)")
    bad = unshowable(value)
    if bad is not None:  # "\0" and an ESC were stored in cache.json and printed raw
        raise ConfigError(f"{name}={value!r:.200}: give a label without {bad!a} "
                          "(no NUL, control or format characters)")
    return value


def flag(value: Any, name: str) -> bool:
    """``value`` as a bool (True, False or a numpy bool), or a ConfigError naming ``name``:
    taken by truthiness, "no" and "false" would mean yes."""
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{name}={value!r:.100}: give True or False")
    return bool(value)


def lies_within(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies below it: by their real paths (links, '..',
    relative paths, trailing slashes), and by the directories themselves where they exist (a
    bind mount shows one directory under two paths)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    if path == folder or path.startswith(folder.rstrip(os.sep) + os.sep):
        return True
    try:
        target = os.stat(folder)
    except OSError:
        return False
    while True:
        with contextlib.suppress(OSError):
            if os.path.samestat(os.stat(path), target):
                return True
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent


def path_argument(value: Any, name: str) -> str:
    """``value`` as a path (a non-empty str or os.PathLike; "" would mean the current
    directory), or a ConfigError naming ``name``."""
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if isinstance(path, str) and path.strip() and "\0" not in path:
            return path
    raise ConfigError(f"{name}={value!r:.200}: give a path" + (
        " (without a NUL character)" if "\0" in str(value) else ""))


# Control characters (ESC, newline, CR...), format marks (the bidi overrides such as U+202E,
# zero-width characters), line and paragraph separators, lone surrogates: a terminal acts on
# them instead of showing them, so a name holding one cannot be printed as it is.
_UNSHOWABLE = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def unshowable(text: str) -> str | None:
    """The first character of ``text`` that cannot be printed as it is (see ``shown``), or
    None."""
    return next((ch for ch in text if unicodedata.category(ch) in _UNSHOWABLE), None)


def shown(text: str) -> str:
    """``text`` with every character a terminal would act on written as its escape
    (``\\x1b``, ``\\u202e``), for printing a name read from disk."""
    if unshowable(text) is None:
        return text
    return "".join(ch if unicodedata.category(ch) not in _UNSHOWABLE
                   else ascii(ch)[1:-1] for ch in text)


def printable(text: object) -> str:
    """``text`` for rich's console: ``shown``, with rich's markup escaped (a path such as
    ``data[1]`` was printed as ``data``, and ``x[/]y`` raised a MarkupError)."""
    from rich.markup import escape

    return escape(shown(str(text)))


def env_number(name: str, default: int, low: int, high: int | None = None) -> int:
    """Environment variable ``name`` as a whole number in [low, high], ``default`` when it
    is unset or empty, or a ConfigError naming it (not a bare ValueError from ``int()``)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 18) or int(raw) < low or \
            (high is not None and int(raw) > high):
        span = f"from {low:,} to {high:,}" if high is not None else f"of at least {low}"
        raise ConfigError(f"{name}={raw!r:.40} in the environment: set a whole number "
                          f"{span}, or unset it")
    return int(raw)


def env_seconds(name: str, default: float, low: float, high: float) -> float:
    """Environment variable ``name`` as seconds in [low, high], ``default`` when it is unset
    or empty, or a ConfigError naming it (not NaN, an infinity or a bare ValueError)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not low <= value <= high:  # NaN is in no range
        raise ConfigError(f"{name}={raw!r:.40} in the environment: set seconds from {low:,} "
                          f"to {high:,}, or unset it")
    return value


def launch_rank_world() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) as torchrun sets them in the environment; (0, 1) when unset."""
    rank, world = env_number("RANK", 0, 0), env_number("WORLD_SIZE", 1, 1)
    if rank >= world:
        raise ConfigError(f"RANK={rank} is not below WORLD_SIZE={world} in the environment")
    return rank, world
