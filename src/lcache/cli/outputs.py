"""The checks every command makes on a file it will write, before any long work."""

from __future__ import annotations

import os
from collections.abc import Iterable

from lcache.errors import ConfigError
from lcache.io.publish import special_kind


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
