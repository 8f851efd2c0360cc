"""Hypothesis strategies for store keys and values (imports hypothesis: test-only module)."""

from __future__ import annotations

from hypothesis import strategies as st

from lcache.testing.values import MAX_VALUE, pattern_bytes

Key = int | bytes

#: A few byte keys used over and over, so that overwrites and deletes hit existing keys.
COMMON_BYTE_KEYS = (b"a", b"b", b"key", b"\x00", b"\xff" * 8, b"sample/000017", b"x" * 100)
#: Int keys past the index's initial size force it to grow.
LARGE_INT_KEYS = (65_535, 65_536, 1_000_003)


def int_keys(max_dense: int = 40) -> st.SearchStrategy[int]:
    """Mostly dense small ints (many overwrites), sometimes one past the index's first size."""
    return st.one_of(
        st.integers(0, max_dense),
        st.integers(0, max_dense),
        st.integers(0, max_dense),
        st.sampled_from(LARGE_INT_KEYS),
    )


def byte_keys() -> st.SearchStrategy[bytes]:
    """Mostly a small fixed set, sometimes any 1..32 bytes."""
    return st.one_of(
        st.sampled_from(COMMON_BYTE_KEYS),
        st.sampled_from(COMMON_BYTE_KEYS),
        st.binary(min_size=1, max_size=32),
    )


def keys(max_dense: int = 40) -> st.SearchStrategy[Key]:
    return st.one_of(int_keys(max_dense), byte_keys())


def values(max_size: int = MAX_VALUE) -> st.SearchStrategy[bytes]:
    """Values of 0..``max_size`` bytes: often tiny, sometimes near the maximum.

    Large values are built from a drawn (size, seed) pair rather than drawn byte by byte, which
    keeps generation fast and shrinking meaningful.
    """
    small = st.binary(max_size=64)
    sized = st.builds(
        pattern_bytes,
        st.one_of(st.integers(0, 4096), st.integers(0, max_size),
                  st.integers(max(0, max_size - 1024), max_size)),
        st.integers(-(2**31), 2**31 - 1),
    )
    return st.one_of(small, sized)
