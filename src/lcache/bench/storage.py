"""The dataset on S3 (DLIO's ``storage_type: s3``), through fsspec as lcache's sources read it.

DLIO reaches S3 through s3torchconnector with ``storage.storage_options``
(``storage/s3_torch_storage.py`` at commit e1919d7b); here the same options drive s3fs:
``access_key_id`` / ``secret_access_key`` are the credentials, ``endpoint_url`` the server,
``region`` its region, ``s3_force_path_style: True`` path-style addressing and
``s3_max_attempts`` the retries. Objects are ``DATA/train/NAME`` under the data folder's URL.
Reads go through :class:`lcache.data.sources.FileSource`, so ``--trace`` sees them as
``data-source`` reads; writes are fsspec ``pipe_file`` calls (one PUT per file).
"""

from __future__ import annotations

from typing import Any

from lcache.bench.config import Workload
from lcache.errors import ConfigError
from lcache.io.urls import filesystem_of


def fsspec_options(w: Workload) -> dict[str, Any]:
    """s3fs keyword arguments from DLIO's ``storage.storage_options``."""
    opts = w.storage_options
    out: dict[str, Any] = {}
    if opts.get("access_key_id"):
        out["key"] = opts["access_key_id"]
    if opts.get("secret_access_key"):
        out["secret"] = opts["secret_access_key"]
    if opts.get("endpoint_url"):
        out["endpoint_url"] = opts["endpoint_url"]
    if opts.get("region"):
        out["client_kwargs"] = {"region_name": opts["region"]}
    config: dict[str, Any] = {"retries": {"max_attempts": w.s3_max_attempts}}
    if opts.get("s3_force_path_style"):
        config["s3"] = {"addressing_style": "path"}
    out["config_kwargs"] = config
    return out


def filesystem(w: Workload) -> Any:
    """The s3fs filesystem of the workload's data folder."""
    try:
        fs, _ = filesystem_of(w.data_folder, fsspec_options(w))
    except ConfigError as exc:
        if isinstance(exc.__cause__, ImportError):
            raise ConfigError(f"{w.source}: storage_type s3 needs s3fs: pip install "
                              "'lcache[s3]' (or s3fs)") from exc
        raise
    return fs


def _strip(url: str) -> str:
    return url.removeprefix("s3://")


def make_bucket(w: Workload) -> None:
    """Create the data folder's bucket if it is missing (DLIO's ``create_namespace``)."""
    fs = filesystem(w)
    bucket = _strip(w.data_folder).split("/", 1)[0]
    try:
        if not fs.exists(bucket):
            # us-east-1 takes no location constraint (which s3fs's mkdir would send)
            fs.call_s3("create_bucket", Bucket=bucket)
    except Exception as exc:  # botocore's errors are not OSErrors
        raise ConfigError(f"cannot reach or create the bucket {bucket} at "
                          f"{w.storage_options.get('endpoint_url', 'the default endpoint')}: "
                          f"{type(exc).__name__}: {exc}") from None


def put(w: Workload, url: str, data: bytes | memoryview) -> None:
    """Write one object whole (a PUT is atomic: readers see all of it or nothing)."""
    try:
        filesystem(w).pipe_file(_strip(url), bytes(data))
    except Exception as exc:
        raise ConfigError(f"cannot write {url}: {type(exc).__name__}: {exc}") from None


def listing(w: Workload, url: str, suffix: str) -> dict[str, int]:
    """Objects under ``url`` whose names end with ``suffix``: URL -> size."""
    fs = filesystem(w)
    try:
        found = fs.find(_strip(url), detail=True)
    except FileNotFoundError:
        return {}
    except Exception as exc:
        raise ConfigError(f"cannot list {url}: {type(exc).__name__}: {exc}") from None
    return {f"s3://{p}": int(info.get("size") or 0) for p, info in found.items()
            if p.endswith(suffix) and info.get("type") != "directory"}


def source(w: Workload, urls: list[str]) -> Any:
    """A :class:`lcache.data.sources.FileSource` over ``urls`` (under the data folder)."""
    from lcache.data.sources import FileSource

    root = w.data_folder.rstrip("/")
    rel = [u[len(root) + 1:] for u in urls]
    return FileSource(root, files=rel, storage_options=fsspec_options(w))
