"""``ImageFolderSource`` against torchvision's own ``ImageFolder`` listing of the same tree
(tests/data/imagefolder/expected.json, made by tests/data/make_fixtures.py): the same
classes, the same order, the same labels; items are ``(bytes, label)``, from the source and
from the cache; a new class that renumbers the labels drops what was cached under the old."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import numpy as np
import pytest

from lcache.data import CachedDataset, ImageFolderSource, SourceError
from lcache.testing.remote import ThrottledServer

from .data.make_fixtures import payload

EXPECTED = json.loads((Path(__file__).parent / "data" / "imagefolder" / "expected.json")
                      .read_text())


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "remote" / "train"
    for i, name in enumerate(EXPECTED["tree"]):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(payload(i, "img"))
    return root


def _content(relative: str) -> bytes:
    return payload(EXPECTED["tree"].index(relative), "img")


def _relative(src: ImageFolderSource, root: str) -> list[str]:
    return [unquote(p[len(root.rstrip("/")) + 1:]) for p in src.paths]


def test_same_classes_order_and_labels_as_torchvision(tree: Path) -> None:
    src = ImageFolderSource(str(tree))
    assert src.classes == EXPECTED["classes"]
    assert src.class_to_idx == {c: i for i, c in enumerate(EXPECTED["classes"])}
    assert [[p, int(c)] for p, c in zip(_relative(src, str(tree)), src.labels,
                                        strict=True)] == EXPECTED["samples"]
    assert tuple(EXPECTED["extensions"]) == ImageFolderSource.EXTENSIONS
    for i, (name, label) in enumerate(EXPECTED["samples"]):
        assert src.decode(src.fetch(i)) == (_content(name), label)
        assert src.path_of(i) == str(tree / name)
    assert src.sizes().tolist() == [len(_content(n)) + 4 for n, _ in EXPECTED["samples"]]


def test_over_http_and_through_the_cache(tree: Path, tmp_path: Path) -> None:
    with ThrottledServer(str(tree.parent)) as server:
        url = server.url + "/train/"
        src = ImageFolderSource(url)
        assert src.classes == EXPECTED["classes"]  # "a b", not "a%20b"
        assert [[p, int(c)] for p, c in zip(_relative(src, url), src.labels,
                                            strict=True)] == EXPECTED["samples"]
        ds = CachedDataset(src, tmp_path / "cache", "16MiB")
        want = [(_content(n), label) for n, label in EXPECTED["samples"]]
        for _ in range(2):  # miss, then hit: the label comes back with the bytes
            assert [ds[i] for i in range(len(ds))] == want
        assert ds.stats()["from_ssd"] == len(want)


def test_classes_whose_names_need_quoting_over_http(tmp_path: Path) -> None:
    """The test server redirected "a%20b" (no slash) to the unquoted "a b/", another class:
    listing it failed, or listed the other one's files (attack helper 67)."""
    root = tmp_path / "train"
    classes = ["a b", "a%20b", "a+b", "\u00e9", "z%zz"]
    for i, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        (root / name / "x.jpg").write_bytes(payload(i, "img"))
    local = ImageFolderSource(str(root))
    with ThrottledServer(str(tmp_path)) as server:
        remote = ImageFolderSource(server.url + "/train/")
        assert remote.classes == local.classes == sorted(classes)
        assert [remote.decode(remote.fetch(i)) for i in range(len(classes))] == \
            [local.decode(local.fetch(i)) for i in range(len(classes))]


def test_a_new_class_drops_the_samples_whose_label_changed(tree: Path, tmp_path: Path) -> None:
    ds = CachedDataset(ImageFolderSource(str(tree)), tmp_path / "cache", "16MiB")
    before = [ds[i] for i in range(len(ds))]
    ds.cache.close()
    (tree / "Aardvark").mkdir()  # sorts first: every label moves up by one
    (tree / "Aardvark" / "q.jpg").write_bytes(b"ant")
    again = CachedDataset(ImageFolderSource(str(tree)), tmp_path / "cache", "16MiB")
    assert again.cache.invalidated == len(before)
    got = [again[i] for i in range(len(again))]
    assert got == [(b"ant", 0)] + [(data, label + 1) for data, label in before]


def test_no_images(tmp_path: Path) -> None:
    (tmp_path / "cls").mkdir()
    (tmp_path / "cls" / "a.txt").write_bytes(b"x")
    (tmp_path / "top.jpg").write_bytes(b"x")  # not in a class folder
    with pytest.raises(SourceError, match=r"no samples found .* with suffixes \('.jpg', "
                                          r".*\(case ignored\); it holds 2 other files"):
        ImageFolderSource(str(tmp_path))


def test_labels_match_a_plain_walk(tree: Path) -> None:
    """Independent of the fixture: each sample's label is its top folder's rank."""
    src = ImageFolderSource(str(tree))
    tops: list[Any] = [Path(p).relative_to(tree).parts[0] for p in src.paths]
    assert np.array_equal(src.labels, [sorted(set(tops)).index(t) for t in tops])


def test_a_label_change_in_place_is_seen(tree: Path, tmp_path: Path) -> None:
    """With files= the order is the user's: a class added at the end renumbers the others
    without moving them, and only the label in the fingerprint tells."""
    names = ["dog/x.png", "cat/a9.jpg"]
    ds = CachedDataset(ImageFolderSource(str(tree), files=names), tmp_path / "cache", "16MiB")
    assert [ds[0][1], ds[1][1]] == [1, 0]
    ds.cache.close()
    src = ImageFolderSource(str(tree), files=[*names, "Bird/z.jpeg"])
    assert src.classes == ["Bird", "cat", "dog"]
    again = CachedDataset(src, tmp_path / "cache", "16MiB")
    assert again.cache.invalidated == 2
    assert [again[i] for i in range(3)] == [(_content("dog/x.png"), 2),
                                            (_content("cat/a9.jpg"), 1),
                                            (_content("Bird/z.jpeg"), 0)]


def test_a_class_that_is_a_link_to_another_class_is_numbered_as_torchvision_does(
        tmp_path: Path) -> None:
    """The finding: ``a -> b`` beside ``c``: the walk skipped ``b`` (reached again), so
    torchvision's classes a, b, c were lcache's a, c, and c's label 2 was 1 here. torchvision
    (``find_classes``, ``os.walk(followlinks=True)``) gives ``b``'s images to both names."""
    root = tmp_path / "train"
    (root / "b").mkdir(parents=True)
    (root / "c").mkdir()
    (root / "b" / "x.jpg").write_bytes(b"x" * 10)
    (root / "c" / "y.jpg").write_bytes(b"y" * 10)
    (root / "a").symlink_to(root / "b")
    ds = CachedDataset(ImageFolderSource(str(root)), tmp_path / "cache", "16MiB")
    assert ds.cache.source.classes == ["a", "b", "c"]
    assert [ds[i] for i in range(len(ds))] == [(b"x" * 10, 0), (b"x" * 10, 1), (b"y" * 10, 2)]


def test_a_class_that_links_into_another_class_is_walked_as_torchvision_does(
        tmp_path: Path) -> None:
    """The finding (attack helper 54): ``b -> c/inner`` and ``z -> a/sub``: the folder
    reached first through the link was skipped at its own place, so class c vanished (and
    m's label moved from 3 to 2) and a lost a/sub's image. torchvision walks each class on
    its own (``os.walk(followlinks=True)``), so the folder's images are in both classes."""
    root = tmp_path / "train"
    files = {"a/top.jpg": b"top", "a/sub/s.jpg": b"sub", "c/inner/i.jpg": b"inner",
             "m/m.jpg": b"m"}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / "b").symlink_to(root / "c" / "inner")
    (root / "z").symlink_to(root / "a" / "sub")
    ds = CachedDataset(ImageFolderSource(str(root)), tmp_path / "cache", "16MiB")
    assert ds.cache.source.classes == ["a", "b", "c", "m", "z"]
    assert [ds[i] for i in range(len(ds))] == [
        (b"top", 0), (b"sub", 0), (b"inner", 1), (b"inner", 2), (b"m", 3), (b"sub", 4)]
