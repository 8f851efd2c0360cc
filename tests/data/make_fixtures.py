"""Write the shard fixtures of tests/test_formats_*.py with each format's own writer.

    python tests/data/make_fixtures.py tests/data     # in the peers' venv, never lcache's

Needs webdataset, mosaicml-streaming, litdata and torchvision (the versions in
tests/data/README.md; torchvision's pure-Python ``datasets.folder`` is loaded without its
compiled ops, which need a matching CUDA build of torch).
Every field a writer is given is derived from ``payload`` (also in the tests), and
``expected.json`` beside each fixture lists what each sample held, so the tests compare
the bytes lcache reads with what the writer was given without running the writer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import types
from typing import Any

import numpy as np

LONG_KEY = "nested/" + "k" * 110  # > 100 bytes: the tar writer needs a pax header for it


def payload(i: int, field: str) -> bytes:
    """Sample ``i``'s ``field``: 1..2999 pseudo-random bytes, a function of (i, field)."""
    n = 1 + int.from_bytes(hashlib.sha256(f"{i}:{field}:n".encode()).digest()[:4], "little") % 2999
    return hashlib.shake_256(f"lcache-fixture:{i}:{field}".encode()).digest(n)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fresh(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    return path


def write_webdataset(out: str) -> list[dict[str, Any]]:
    import webdataset as wds

    os.makedirs(_fresh(out))
    expected = []
    # A float mtime and a long key make the writer emit pax headers, as real shards have.
    with wds.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxcount=5, mtime=1700000000.25,
                         verbose=0) as sink:
        for i in range(12):
            key = LONG_KEY if i == 7 else (f"train/s{i:04d}" if i % 3 == 0 else f"s{i:04d}")
            sample = {"__key__": key, "bin": payload(i, "bin"), "cls": i % 4,
                      "json": {"i": i, "name": f"n{i}"}}
            if i % 2:
                sample["seg.png"] = payload(i, "seg")
            sink.write(sample)
            fields = {"bin": payload(i, "bin"), "cls": str(i % 4).encode(),
                      "json": json.dumps({"i": i, "name": f"n{i}"}).encode()}
            if i % 2:
                fields["seg.png"] = payload(i, "seg")
            expected.append({"key": key, "fields": {k: _sha(v) for k, v in fields.items()}})
    return expected


def _import_streaming() -> Any:
    # streaming's __init__ imports its vision datasets, which need torchvision: not used here.
    sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


MDS_COLUMNS = {"data": "bytes", "label": "int", "name": "str", "vec": "ndarray:float32:4",
               "meta": "json", "blob": "pkl", "small": "uint8"}


def _mds_sample(i: int) -> dict[str, Any]:
    return {"data": payload(i, "data"), "label": i * 7 - 20, "name": f"sample-{i}",
            "vec": np.arange(4, dtype=np.float32) * i, "meta": {"i": i, "even": i % 2 == 0},
            "blob": {"never": "unpickled", "i": i}, "small": i % 256}


def write_mds(out: str, compression: str | None = None, n: int = 9) -> list[dict[str, Any]]:
    MDSWriter = _import_streaming().MDSWriter

    with MDSWriter(out=_fresh(out), columns=MDS_COLUMNS, size_limit=8000,
                   compression=compression, hashes=["sha1", "xxh64"]) as writer:
        for i in range(n):
            writer.write(_mds_sample(i))
    return [{"data": _sha(payload(i, "data")), "label": i * 7 - 20, "name": f"sample-{i}",
             "vec": [float(v) for v in np.arange(4, dtype=np.float32) * i],
             "meta": {"i": i, "even": i % 2 == 0}, "small": i % 256} for i in range(n)]


def _litdata_item(i: int) -> dict[str, Any]:
    return {"data": payload(i, "data"), "label": i * 3 - 5, "name": f"item-{i}",
            "arr": np.arange(3, dtype=np.float32) + i}


def write_litdata(out: str) -> list[dict[str, Any]]:
    import litdata

    litdata.optimize(fn=_litdata_item, inputs=list(range(10)), output_dir=_fresh(out),
                     chunk_bytes=6000, num_workers=1, keep_data_ordered=True, verbose=False)
    return [{"data": _sha(payload(i, "data")), "label": i * 3 - 5, "name": f"item-{i}",
             "arr": [float(i + k) for k in range(3)]} for i in range(10)]


# An ImageNet-style tree with what makes its order subtle: upper-case class and extension,
# a space, nested folders beside files, numbers that sort as text, files that are not
# images, and a file directly under the root (not a sample).
IMAGEFOLDER_TREE = [
    "cat/a10.jpg", "cat/a9.jpg", "cat/b.JPEG", "cat/notes.txt", "dog/x.png", "dog/y.webp",
    "Bird/z.jpeg", "a b/one.bmp", "zebra/y.jpg", "zebra/sub.jpg", "zebra/sub/x.jpg",
    "zebra/sub2/z.PNG", "zebra/sub/deeper/w.tif", "top.jpg",
]


def _torchvision_folder() -> Any:
    import importlib
    import site

    for name in ("torchvision", "torchvision.datasets"):  # packages without their __init__
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(site.getsitepackages()[0], *name.split("."))]
        sys.modules[name] = module
    return importlib.import_module("torchvision.datasets.folder")


def write_imagefolder(out: str) -> dict[str, Any]:
    """torchvision's classes and (path, label) list for IMAGEFOLDER_TREE (the files hold
    ``payload(i, "img")``); the test rebuilds the tree and compares."""
    folder = _torchvision_folder()
    os.makedirs(_fresh(out))
    for i, name in enumerate(IMAGEFOLDER_TREE):
        os.makedirs(os.path.dirname(os.path.join(out, name)), exist_ok=True)
        with open(os.path.join(out, name), "wb") as f:
            f.write(payload(i, "img"))
    classes, class_to_idx = folder.find_classes(out)
    samples = folder.make_dataset(out, class_to_idx, extensions=folder.IMG_EXTENSIONS)
    shutil.rmtree(out)
    return {"tree": IMAGEFOLDER_TREE, "classes": classes,
            "samples": [[os.path.relpath(p, out), label] for p, label in samples],
            "extensions": list(folder.IMG_EXTENSIONS)}


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("webdataset", "mosaicml-streaming", "litdata",
                                     "torchvision", "numpy")}


def main(root: str) -> None:
    for name, write in (("webdataset", write_webdataset), ("mds", write_mds),
                        ("litdata", write_litdata)):
        folder = os.path.join(root, name)
        expected = write(os.path.join(folder, "shards"))
        with open(os.path.join(folder, "expected.json"), "w") as f:
            json.dump({"writer": versions(), "samples": expected}, f, indent=1)
    expected = write_mds(os.path.join(root, "mds-zstd", "shards"), compression="zstd", n=3)
    with open(os.path.join(root, "mds-zstd", "expected.json"), "w") as f:
        json.dump({"writer": versions(), "samples": expected}, f, indent=1)
    listing = write_imagefolder(os.path.join(root, "imagefolder", "tree"))
    with open(os.path.join(root, "imagefolder", "expected.json"), "w") as f:
        json.dump({"writer": versions(), **listing}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
