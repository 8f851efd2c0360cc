"""YAML that users hand to lcache (DLIO workloads, ``--set`` values, model files), read safely.

PyYAML's SafeLoader constructs no Python objects, but it still accepts aliases (``*name``: a
"billion laughs" document of a few lines expands exponentially when it is compared or
printed), explicit tags (``!!timestamp null`` crashes PyYAML itself; ``!!python/...`` is a
ConstructorError), unbounded nesting (the composer recurses) and a key given twice (the last
one silently wins). None of these has a place in a configuration file, so they are refused,
as is a file that is not a regular file (a FIFO would block, ``/dev/zero`` never ends) or over
1 MiB. Every failure is one ``ConfigError``.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from lcache.errors import ConfigError
from lcache.io import close_file
from lcache.io.files import NotRegularFile, open_regular

MAX_FILE_BYTES = 1 << 20  # configuration files are a few KiB
MAX_DEPTH = 16  # a workload is sections of keys, parallelism/transformer one level more


class _Loader(yaml.SafeLoader):
    """SafeLoader without aliases, explicit tags or nesting deeper than ``MAX_DEPTH``."""

    def __init__(self, stream: bytes | str, what: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._what = what

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        problem = ""
        if isinstance(event, yaml.AliasEvent):
            problem = f"YAML aliases (*name) are not allowed in a {self._what}; write the " \
                      "value out"
        elif getattr(event, "tag", None) not in (None, "!"):
            tag = event.tag.replace("tag:yaml.org,2002:", "!!")
            problem = (f"the tag {tag[:80]} is not allowed: a {self._what} holds plain values "
                       "(numbers, strings, booleans, lists, mappings)")
        elif self._depth >= MAX_DEPTH:
            problem = f"nested deeper than {MAX_DEPTH} levels"
        if problem:
            raise yaml.composer.ComposerError(None, None, problem, event.start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        mapping = super().construct_mapping(node, deep=deep)
        if len(mapping) < len(node.value):  # PyYAML keeps the last of a repeated key
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {str(key)[:80]!r} is given twice; keep one",
                        key_node.start_mark)
                seen.add(key)
        return mapping


def _problem(exc: yaml.YAMLError) -> str:
    if not isinstance(exc, yaml.MarkedYAMLError):
        return " ".join(str(exc).split())
    problem = exc.problem or exc.context or "invalid YAML"
    mark = exc.problem_mark or exc.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    return where + " ".join(problem.split())


def load_yaml(text: bytes | str, where: str, what: str = "workload") -> Any:
    """Parse YAML text safely: plain values only (no tags, no aliases, at most 16 levels).

    Args:
        where: the file or option it came from; every message starts with it.
        what: the kind of document, for the messages ("workload", "model file").

    Raises:
        ConfigError: anything that is not such a document.
    """
    try:
        loader = _Loader(text, what)
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML for a {what}: {_problem(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to be a {what}") from None
    except (ValueError, OverflowError) as exc:  # int() of 5,000 digits, a 30th of February
        text = " ".join(str(exc).split())
        raise ConfigError(f"{where}: not valid YAML for a {what}: {text[:120]}") from None


def read_file(path: str, what: str = "workload", hint: str = "") -> bytes:
    """The bytes of a configuration file: a regular file of at most 1 MiB.

    Args:
        what: the kind of file, for the messages.
        hint: appended to the "does not exist" and "is a directory" messages.
    """
    try:
        fd = open_regular(path, os.O_RDONLY, follow=True)  # a FIFO must not block
    except FileNotFoundError:
        raise ConfigError(f"{what} file {path} does not exist{hint}") from None
    except NotRegularFile as exc:
        if exc.kind == "a directory":
            raise ConfigError(f"{path} is a directory; give a {what} file{hint}") from None
        raise ConfigError(f"{path} is not a regular file; give a {what} file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} file {path}: {exc.strerror}") from None
    try:
        chunks, total = [], 0
        while total <= MAX_FILE_BYTES:
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} file {path}: {exc.strerror}") from None
    finally:
        close_file(fd)
    if total > MAX_FILE_BYTES:
        raise ConfigError(f"{path} is over {MAX_FILE_BYTES >> 20} MiB; a {what} file is a few "
                          "KiB of YAML")
    return b"".join(chunks)
