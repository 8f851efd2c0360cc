"""Checks of what a command is given: the files it will write (before any long work) and
the numbers it is given."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from typing import Any

import click

from lcache.errors import ConfigError
from lcache.io.publish import special_kind


class Folder(click.Path):
    """A directory argument; an empty one, which the system would read as the current
    directory, is refused."""

    def __init__(self) -> None:
        super().__init__(file_okay=False)

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("an empty path; give a directory", param, ctx)
        return super().convert(value, param, ctx)


def check_output(path: str, what: str, inputs: Iterable[str] = ()) -> None:
    """Refuse to write the ``what`` (trace, report...) at ``path`` when its directory is
    missing, when it is a device, FIFO, socket or directory (writing replaces the file: as
    root, ``-o /dev/null`` would replace the system's), or when it is one of ``inputs``
    (the command would destroy what it reads)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"cannot write the {what} {path}: the directory {folder} does not "
                          "exist; create it or choose another path")
    kind = special_kind(path)
    if kind is not None:
        raise ConfigError(f"cannot write the {what} {path}: it is {kind}, and writing "
                          "replaces it; choose a regular file or a new name")
    for given in inputs:
        try:
            same = os.path.samefile(path, given)
        except OSError:
            continue
        if same:
            raise ConfigError(f"cannot write the {what} {path}: it is the input {given}, "
                              "which writing would destroy; choose another path")


def number(value: Any, option: str, kind: type, lo: float, hi: float) -> Any:
    """``value`` (as typed) as ``kind`` in [lo, hi], or a ConfigError naming ``option``
    (NaN and infinities are never in range)."""
    span = f"{lo:,}..{hi:,}" if kind is int else f"{lo:g}..{hi:g}"
    try:
        n = kind(value)
    except ValueError:
        what = "a number"
        if kind is int:
            with contextlib.suppress(ValueError):
                float(value)
                what = "a whole number written with digits only (1000000, not 1e6)"
        raise ConfigError(f"{option} {value!r:.40} is not {what}; give one in {span}") from None
    if not lo <= n <= hi:
        raise ConfigError(f"{option} {n:g} is out of range; give one in {span}")
    return n


def number_option(option: str, kind: type, lo: float, hi: float
                  ) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """A click callback that checks an option with :func:`number`."""
    return lambda ctx, param, value: number(value, option, kind, lo, hi)
