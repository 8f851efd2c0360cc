"""The fsspec filesystem of a URL or a local path: the one way every layer opens one."""

from __future__ import annotations

import os
import re
from typing import Any

from lcache.errors import ConfigError

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")


def filesystem_of(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """``(filesystem, path)`` of ``url``, a URL (``s3://bucket/data``) or a local path.

    fsspec reads ``::`` as a chain of filesystems (``simplecache::s3://...``), so through it
    the folder ``/data/a::b`` would be read as ``/data/a``: another dataset's bytes. A local
    path is taken as it is written; a URL holding ``::`` is refused (lcache takes no
    chained filesystems: it is the cache).

    Raises:
        ConfigError: a URL with ``::``, or one fsspec cannot open (an unknown protocol, a
            missing package).
    """
    import fsspec.core

    options = storage_options or {}
    if "::" in url:
        scheme, sep, _ = url.partition("://")
        if sep and _SCHEME.fullmatch(scheme) and scheme != "file":
            raise ConfigError(f"cannot open {url}: fsspec reads '::' as a chain of "
                              "filesystems, which lcache does not take; rename the object or "
                              "folder, or give the URL without a chain")
        from fsspec.implementations.local import LocalFileSystem

        _refuse_local_options(url, options)
        return LocalFileSystem(**options), os.path.abspath(url.removeprefix("file://"))
    if url.lower().startswith(("http://", "https://")):
        # the bytes as stored: a server that gzips what it sends (nginx's gzip, which also
        # drops Range) would have them inflated by aiohttp to another size than the listed
        options = {**options, "headers": {"Accept-Encoding": "identity",
                                          **(options.get("headers") or {})}}
    if "://" not in url or url.lower().startswith("file://"):
        _refuse_local_options(url, options)
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"cannot open {url}: {exc}") from exc
    return fs, str(path)


def _refuse_local_options(url: str, options: dict[str, Any]) -> None:
    """fsspec's local filesystem takes any option and ignores it: ``-o endpoint_url=...``
    given with a local path would be silently dropped (a path meant as a bucket?)."""
    if options:
        raise ConfigError(f"storage options {sorted(options)} mean nothing to the local path "
                          f"{url}; give them with a remote URL (s3://, gs://, http://...)")
