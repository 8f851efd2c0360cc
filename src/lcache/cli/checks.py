"""Checks of what a command is given: the files it will write (before any long work) and
the numbers it is given."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
from collections.abc import Callable, Iterable
from typing import Any

import click

from lcache.errors import ConfigError
from lcache.io.files import close_file, kind_of, open_regular
from lcache.io.publish import names_directory, special_kind


class Folder(click.Path):
    """A directory argument; an empty one, which the system would read as the current
    directory, is refused, and so is one that names no directory: a device, a FIFO, a link
    loop, a path through a file (a command that then opened DIR/cache.json blamed that
    file). A path that does not exist is the command's to judge (a cache to create)."""

    def __init__(self) -> None:
        super().__init__(file_okay=False)

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("an empty path; give a directory", param, ctx)
        if isinstance(value, (str, os.PathLike)):
            try:
                kind = kind_of(os.stat(value).st_mode)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    self.fail(f"{os.fspath(value)}: too many levels of symbolic links", param,
                              ctx)
                if exc.errno == errno.ENOTDIR:
                    self.fail(f"{os.fspath(value)} is not a directory (a part of its path is "
                              "a file)", param, ctx)
            else:
                if kind not in (None, "a directory"):  # a regular file: click says so
                    self.fail(f"{os.fspath(value)} is not a directory (it is {kind})", param,
                              ctx)
        return super().convert(value, param, ctx)


def check_output(path: str, what: str, inputs: Iterable[str] = ()) -> None:
    """Refuse to write the ``what`` (trace, report...) at ``path`` when its directory is
    missing, when it is a device, FIFO, socket or directory (writing replaces the file: as
    root, ``-o /dev/null`` would replace the system's), or when it is one of ``inputs``
    (the command would destroy what it reads), or when its name ends in ``/`` (it names a
    directory)."""
    if names_directory(path):
        raise ConfigError(f"cannot write the {what} {path}: it ends in '/', '.' or '..', so it "
                          "names a directory; give a file name")
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


#: an output given as this is printed on stdout (where the output is text a pipe takes)
STDOUT = "-"


def check_outputs(outputs: Iterable[tuple[str, str | None, str, bool]],
                  inputs: Iterable[str] = ()) -> None:
    """Check every output a command was given, before any long work. ``outputs`` holds
    ``(option, path or None, what, printable)``: an empty path is refused (the system would
    read it as the current directory); ``-`` is stdout where ``printable`` (JSON, YAML) and
    refused elsewhere (an HTML page, a trace: files to open, not text to pipe); two outputs
    on one file (by any name or link, as the file system resolves it) or both on stdout are
    refused, naming both options (one would overwrite the other); each file is then checked
    by :func:`check_output`."""
    inputs = list(inputs)
    seen: list[tuple[str, str]] = []
    for option, path, what, printable in outputs:
        if path is None:
            continue
        if path == STDOUT:
            if not printable:
                raise ConfigError(f"{option} -: the {what} is written to a file ('-' prints "
                                  "only the JSON and YAML outputs); give a file name")
        elif not path.strip():
            raise ConfigError(f"{option} {path!r}: an empty path; give a file name")
        else:
            check_output(path, what, inputs)
        for other_option, other in seen:
            if _same_output(path, other):
                clash = ("print on stdout, where they would mix; give one a file name"
                         if path == STDOUT else f"write {path}, and one would overwrite the "
                         "other; give each its own path")
                raise ConfigError(f"{other_option} and {option} both {clash}")
        seen.append((option, path))


def check_replaceable(outputs: Iterable[tuple[str, str | None, str, Callable[[bytes], bool]]]
                      ) -> None:
    """Refuse to write an output where a file lcache did not write is: ``outputs`` holds
    ``(option, path or None, what, ours)``, and ``ours`` tells a ``what`` lcache wrote from
    the file's first 4 KiB. Writing replaces the file, and an output with a default
    (``report`` writes ./report.html unasked) or a mistyped name replaced a user's file
    without a word. A symbolic link there is refused too (replacing it removes the link,
    which lcache did not make). Call it with every output, before any long work."""
    for option, path, what, ours in outputs:
        if path is None or path == STDOUT:
            continue
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        advice = f"give {option} another path, or move the file"
        if stat.S_ISLNK(mode):
            raise ConfigError(f"cannot write the {what} {path}: it is a symbolic link, and "
                              f"writing would replace it; {advice}")
        try:
            fd = open_regular(path, os.O_RDONLY)
            try:
                head = os.pread(fd, 4096, 0)
            finally:
                close_file(fd)
        except OSError as exc:
            raise ConfigError(f"cannot write the {what} {path}: a file there cannot be read "
                              f"({exc.strerror or exc}), so it may not be one lcache wrote, "
                              f"and writing would replace it; {advice}") from None
        if not ours(head):
            a = "an" if what[0] in "aeiou" else "a"
            raise ConfigError(f"cannot write the {what} {path}: the file there is not {a} "
                              f"{what} lcache wrote, and writing would replace it; {advice}")


def output_option(*decls: str, what: str, default: str | None = None,
                  **kwargs: Any) -> Callable[[Any], Any]:
    """``click.option(*decls, ...)`` for a command's one ``what`` file (trace, report...),
    given once at most: click keeps the last of an option given twice and drops the others
    silently, so it is taken with ``multiple=True`` and a repeat is refused, naming each."""

    def one(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> str | None:
        if len(values) > 1:
            raise ConfigError(f"{param.opts[0]} given {len(values)} times "
                              f"({', '.join(values)}); give one {what}")
        return values[0] if values else None

    return click.option(*decls, multiple=True, callback=one,
                        default=() if default is None else (default,), **kwargs)


def _same_output(a: str, b: str) -> bool:
    if STDOUT in (a, b):
        return a == b
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)  # hard links
    except OSError:
        return False


def number(value: Any, option: str, kind: type, lo: float, hi: float) -> Any:
    """``value`` (as typed) as ``kind`` in [lo, hi], or a ConfigError naming ``option``
    (NaN and infinities are never in range)."""
    span = f"{lo:,}..{hi:,}" if kind is int else f"{lo:g}..{hi:g}"
    sign = digits = ""
    if kind is int and isinstance(value, str):
        typed = value.strip()
        sign = typed[:1] if typed[:1] in ("+", "-") else ""
        digits = typed[len(sign):]
        if digits.isdecimal():  # leading zeros are no digits: 000...08 is 8
            digits = digits.lstrip("0") or "0"
            value = sign + digits
    try:
        n = kind(value)
    except ValueError:
        what = "a number"
        if digits.isdecimal() and len(digits) > sys.get_int_max_str_digits() > 0:
            # digits only, more than Python converts (4,300 by default): out of range,
            # not "not digits only" (lo and hi are far smaller)
            raise ConfigError(f"{option} {sign}{digits[:12]}... ({len(digits):,} digits) "
                              f"is out of range; give one in {span}") from None
        if kind is int:
            with contextlib.suppress(ValueError):
                float(value)
                what = "a whole number written with digits only (1000000, not 1e6)"
        raise ConfigError(f"{option} {value!r:.40} is not {what}; give one in {span}") from None
    if not lo <= n <= hi:
        # as typed, never rounded (1.0000001 printed with :g read "1", inside 0.001..1); a
        # long one cut: a float's repr is exact, a whole number's digits are counted (its
        # sign is no digit)
        typed = value.strip() if isinstance(value, str) else repr(n)
        if len(typed) > 40:
            whole = str(abs(n))
            typed = repr(n) if kind is not int else (
                f"{'-' if n < 0 else ''}{whole[:12]}... ({len(whole):,} digits)")
        raise ConfigError(f"{option} {typed} is out of range; give one in {span}")
    return n


def number_option(option: str, kind: type, lo: float, hi: float
                  ) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """A click callback that checks an option with :func:`number`."""
    return lambda ctx, param, value: number(value, option, kind, lo, hi)
