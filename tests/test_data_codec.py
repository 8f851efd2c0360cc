"""DatasetSource and its codec: items of a map-style dataset (arrays, tensors, numbers,
strings, nested containers) cached and decoded back byte for byte, with the same types, and
what the codec refuses or cannot decode."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lcache.data import CachedDataset, DatasetSource, codec
from lcache.data.codec import CodecError
from lcache.errors import ConfigError, LCacheError

from .test_data_sources import CAPACITY, _blob, _read_all


class _Structured:
    """A map-style dataset of mixed items (what a real ``Dataset.__getitem__`` returns)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        self.calls += 1
        rng = np.random.default_rng(i)
        image = rng.standard_normal((4 + i % 3, 5), dtype=np.float32)
        tokens = torch.from_numpy(rng.integers(-(2**40), 2**40, size=7 + i))
        half = torch.from_numpy(rng.standard_normal(6, dtype=np.float32)).to(torch.bfloat16)
        meta = {"name": f"sample-{i}", "tags": ["x", i], "score": i / 3, "none": None,
                "nested": {"flag": bool(i % 2)}}
        return image, tokens, half, meta, _blob(i, 50 + i), i % 10


def _assert_same(got: Any, want: Any) -> None:
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        if want.dtype == torch.bfloat16:  # compare the bits (NaN, -0.0 included)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        else:
            assert torch.equal(got, want)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _assert_same(g, w)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            _assert_same(got[k], want[k])
    else:
        assert got == want


def test_dataset_source_round_trips_structured_items(tmp_path: Path) -> None:
    inner = _Structured(30)
    ds = CachedDataset(inner, tmp_path / "cache", CAPACITY)
    assert isinstance(ds.cache.source, DatasetSource)
    reference = _Structured(30)
    first = _read_all(ds)  # misses
    for i, item in enumerate(first):
        _assert_same(item, reference[i])
    calls = inner.calls
    for i in random.Random(4).sample(range(30), 30):  # hits: the dataset is not called
        _assert_same(ds[i], reference[i])
    assert inner.calls == calls
    for i, item in enumerate(first):  # items already returned are not disturbed by later reads
        _assert_same(item, reference[i])
    s = ds.stats()
    assert (s["fetches"], s["from_ssd"]) == (30, 30)


def test_codec_refusals() -> None:
    with pytest.raises(CodecError, match="object arrays"):
        codec.encode(np.array([1, "a", None], dtype=object))
    with pytest.raises(CodecError, match="object arrays"):
        codec.encode({"x": [np.array([{}], dtype=object)]})
    with pytest.raises(CodecError, match="dict keys must be str"):
        codec.encode({1: b"x"})
    with pytest.raises(CodecError, match="dict keys must be str"):
        codec.encode([{"ok": {("a", 1): 2}}])
    with pytest.raises(CodecError, match="without pickle"):
        codec.encode({1, 2})
    with pytest.raises(CodecError, match="without pickle"):
        codec.encode(object())
    assert issubclass(CodecError, ValueError)


def test_codec_refuses_what_it_would_get_wrong_and_keeps_what_numpy_lacks(
        tmp_path: Path) -> None:
    """Regression: a masked array came back without its mask, an np.matrix could not be
    decoded, and a huge int, a conjugated or float8 tensor were bare errors."""
    with pytest.raises(CodecError, match="masked array would lose its mask"):
        codec.encode({"x": np.ma.array([1, 2, 3], mask=[0, 1, 0])})
    with pytest.warns(PendingDeprecationWarning), \
            pytest.raises(CodecError, match=r"np\.matrix .* return np\.asarray"):
        codec.encode(np.matrix([[1, 2], [3, 4]]))
    with pytest.raises(CodecError, match="cannot cache this item"):
        codec.encode([10 ** 5000])
    with pytest.raises(CodecError, match="to_dense"):
        codec.encode(torch.eye(2).to_sparse())
    day = np.datetime64("2024-01-02")
    assert codec.decode(codec.encode(day)) == day
    assert codec.decode(codec.encode(np.complex64(1 + 2j))) == 1 + 2j
    conj = torch.tensor([1 + 2j]).conj()
    assert torch.equal(codec.decode(codec.encode(conj)), conj.resolve_conj())
    f8 = torch.tensor([1.5, -2.0]).to(torch.float8_e4m3fn)
    back = codec.decode(codec.encode(f8))
    assert back.dtype == f8.dtype and torch.equal(back.view(torch.uint8), f8.view(torch.uint8))
    mapped = np.memmap(tmp_path / "m", dtype="<f4", mode="w+", shape=(3,))
    mapped[:] = [1, 2, 3]
    assert type(codec.decode(codec.encode(mapped))) is np.ndarray
    assert codec.decode(codec.encode(mapped)).tolist() == [1, 2, 3]


def test_codec_keeps_numpy_scalar_types_and_refuses_subclasses_it_would_flatten() -> None:
    """The findings: np.float32(1.5) came back a Python float (default_collate then makes
    a float64 tensor of it), and a namedtuple, an OrderedDict, a defaultdict, an IntEnum or
    a str subclass came back as the plain type, although what would not come back as given
    is refused."""
    import collections
    import enum

    for scalar in (np.float32(1.5), np.float64(2.5), np.int8(-3), np.uint64(2**64 - 1),
                   np.bool_(True), np.str_("hi"), np.bytes_(b"ab"), np.complex64(1 + 2j)):
        back = codec.decode(codec.encode({"x": [scalar]}))["x"][0]
        assert type(back) is type(scalar) and back == scalar, (scalar, back)

    class Label(enum.IntEnum):
        CAT = 1

    class Name(str):
        pass

    point = collections.namedtuple("point", "x y")
    for item, words in [(point(1, 2), "a point would come back as a plain tuple"),
                        (collections.OrderedDict(a=1), "plain dict"),
                        (collections.defaultdict(int), "plain dict"),
                        (Label.CAT, "a Label would come back as a plain int"),
                        ([Name("x")], "plain str"),
                        ({"k": True, "v": [point(1, 2)]}, r"x\._asdict\(\)")]:
        with pytest.raises(CodecError, match=words):
            codec.encode(item)


def test_dataset_source_refuses_unencodable_items(tmp_path: Path) -> None:
    class Objects:
        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int) -> Any:
            return np.array([object()], dtype=object)

    with pytest.raises(CodecError, match="object arrays"):
        CachedDataset(Objects(), tmp_path / "cache", CAPACITY)


class _Claims:
    """A map-style dataset whose ``__len__`` says ``n``, whatever it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return b"x"


def test_a_huge_len_is_refused_naming_the_length_and_the_memory(tmp_path: Path) -> None:
    # numpy's "_ArrayMemoryError: Unable to allocate 7.28 TiB" before
    with pytest.raises(ConfigError, match=r"1,000,000,000,000 samples, its __len__\) needs "
                                          r"about 7\.3 TiB of memory.*torch.utils.data.Subset"):
        CachedDataset(_Claims(10**12), tmp_path / "cache", CAPACITY)


def test_a_len_past_available_memory_is_refused_before_allocating(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lcache.bench.resources.meminfo", lambda key: 256 << 20)
    with pytest.raises(ConfigError, match=r"134,217,728 samples.*1\.0 GiB of memory.*"
                                          r"256\.0 MiB available"):
        DatasetSource(_Claims(1 << 27))


def test_a_len_past_the_store_keys_is_refused_where_memory_is_unknown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lcache.bench.resources.meminfo", lambda key: 0)  # no /proc/meminfo
    with pytest.raises(ConfigError, match=r"at most 68,719,476,736 samples"):
        DatasetSource(_Claims((1 << 36) + 1))


@pytest.mark.parametrize("n", [1 << 64, -1])
def test_a_len_that_is_no_length_is_a_config_error(n: int) -> None:
    with pytest.raises(ConfigError, match="its __len__ is not a length"):
        DatasetSource(_Claims(n))


def test_codec_errors_are_lcache_errors_and_value_errors(tmp_path: Path) -> None:
    """``except LCacheError`` catches an item the codec refuses (it missed it), and
    ``except ValueError`` still does."""
    class Plain:
        def __len__(self) -> int:
            return 5

        def __getitem__(self, i: int) -> Any:
            return object()

    with pytest.raises(LCacheError, match="without pickle") as caught:
        CachedDataset(Plain(), tmp_path / "cache", CAPACITY)
    assert isinstance(caught.value, CodecError) and isinstance(caught.value, ValueError)
    with pytest.raises(LCacheError, match="not an lcache-encoded item"):
        codec.decode(b"junk")


def test_an_items_torch_size_comes_back_a_torch_size_and_other_torch_objects_are_refused(
        tmp_path: Path) -> None:
    """The finding: any object of torch's module was taken for a tensor, so an item holding
    its tensor's shape ({"x": t, "shape": t.shape}), a dtype or a device raised a bare
    AttributeError out of CachedDataset(...)."""

    class Shaped:
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> Any:
            t = torch.full((2, 3), float(i))
            return {"x": t, "shape": t.shape, "shapes": [torch.Size([]), torch.Size([0, 5])]}

    ds = CachedDataset(Shaped(), tmp_path / "cache", CAPACITY)
    for i in range(4):
        item = ds[i]
        assert type(item["shape"]) is torch.Size and item["shape"] == (2, 3)
        assert [type(s) for s in item["shapes"]] == [torch.Size, torch.Size]
        assert item["shapes"] == [torch.Size([]), torch.Size([0, 5])]
        assert torch.equal(item["x"], torch.full((2, 3), float(i)))
    for obj, name in [(torch.float32, "torch.dtype"), (torch.device("cpu"), "torch.device"),
                      (torch.strided, "torch.layout")]:
        with pytest.raises(CodecError, match=rf"cannot cache a {name} .*str\(x\)"):
            codec.encode({"x": torch.zeros(1), "meta": obj})


@pytest.mark.parametrize("garbage", [b"", b"junk", b"PK\x03\x04" + bytes(60),
                                     b"\x80\x04\x95pickle"])
def test_codec_decode_garbage_without_magic(garbage: bytes) -> None:
    with pytest.raises(CodecError, match="not an lcache-encoded item"):
        codec.decode(garbage)


def _framed(header: bytes, body: bytes = b"") -> bytes:
    return codec.MAGIC + len(header).to_bytes(4, "little") + header + body



@pytest.mark.parametrize("garbage", [
    codec.MAGIC,  # no header length
    _framed(b"{not json"),
    codec.MAGIC + (1000).to_bytes(4, "little") + b'{"v": 1}',  # header longer than the data
    _framed(b"[]"),
    _framed(b'{"x": 1}'),
    _framed(b'{"a": [0, 100], "dtype": "<f4", "shape": [25]}', b"x" * 8),  # past the body
    _framed(b'{"a": [0, 8], "dtype": "|O", "shape": [1]}', b"x" * 8),  # object dtype
    _framed(b'{"size": [2, "3"]}'),
], ids=["magic-only", "bad-json", "short-header", "json-list", "unknown-node", "past-body",
        "object-dtype", "size-not-ints"])
def test_codec_decode_malformed_after_magic(garbage: bytes) -> None:
    with pytest.raises(CodecError):
        codec.decode(garbage)


@pytest.mark.parametrize("item", [np.zeros((0, 4), np.float32), torch.zeros(3, 0)],
                         ids=["numpy-0x4", "torch-3x0"])
def test_codec_round_trips_empty_multidim_arrays(item: Any) -> None:
    _assert_same(codec.decode(codec.encode(item)), item)


@pytest.mark.parametrize("item", [np.array(2.5, np.float32), torch.tensor(3),
                                  torch.tensor(1.5, dtype=torch.bfloat16)],
                         ids=["numpy-0d", "torch-int64-0d", "torch-bf16-0d"])
def test_codec_round_trips_0d_arrays(item: Any) -> None:
    _assert_same(codec.decode(codec.encode(item)), item)


def test_codec_refuses_structured_arrays_and_round_trips_datetimes() -> None:
    with pytest.raises(CodecError, match=r"structured arrays .* cannot be cached without pickle"):
        codec.encode(np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]))
    dates = np.array(["2024-01-01", "1969-12-31"], dtype="datetime64[D]")
    _assert_same(codec.decode(codec.encode(dates)), dates)


_DTYPES = st.sampled_from(["|b1", "|i1", "|u1", "<i2", "<u2", "<i4", ">i4", "<u4", "<i8",
                           "<u8", "<f2", "<f4", ">f8", "<f8", "<c8", "<c16", "<U3", "|S4"])


@st.composite
def _arrays(draw: Any) -> np.ndarray:
    dtype = np.dtype(draw(_DTYPES))
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=5))
    arr = draw(hnp.arrays(dtype, shape))
    if arr.ndim >= 2 and draw(st.booleans()):
        arr = arr.T  # not C-contiguous
    return arr


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arr=_arrays(), label=st.integers(-(2**63), 2**63 - 1),
       name=st.text(max_size=8).filter(lambda s: s not in ("x", "label")))
def test_codec_round_trip_property(arr: np.ndarray, label: int, name: str) -> None:
    item = {"x": arr, "label": label, name: [arr, (b"raw", arr.tobytes())]}
    back = codec.decode(codec.encode(item))
    assert back.keys() == item.keys()
    for got in (back["x"], back[name][0]):
        assert got.dtype == arr.dtype and got.shape == arr.shape
        assert got.tobytes() == np.ascontiguousarray(arr).tobytes()  # bit-exact (NaN too)
    assert back["label"] == label
    assert back[name][1] == (b"raw", arr.tobytes())


_TORCH_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8,
                 torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from(_TORCH_DTYPES),
       shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4),
       seed=st.integers(0, 2**32 - 1))
def test_codec_round_trip_tensors_property(dtype: torch.dtype, shape: tuple[int, ...],
                                           seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16)
    tensor = bits.view(torch.bfloat16) if dtype == torch.bfloat16 else bits.to(dtype)
    _assert_same(codec.decode(codec.encode(tensor)), tensor)
