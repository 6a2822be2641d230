"""The page pool's invariants and the page byte layout."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.core.kvcache import PageLayout, PagePool, pages_for
from disagg.errors import ConfigError, PoolExhausted, ProtocolError


def test_allocate_reserve_free() -> None:
    pool = PagePool(10, 16)
    assert pool.allocate(1, 33) == [0, 1, 2]
    assert pool.reserve(2, 16) == [3]
    assert pool.is_pinned(2) and not pool.is_pinned(1)
    assert pool.free_pages == 6 and pool.used_pages == 4
    assert pool.free(1) == 3
    assert pool.allocate(3, 16) == [0]  # freed pages are reused, lowest first
    pool.check()


def test_double_free_and_unknown_owner_are_errors() -> None:
    pool = PagePool(4, 16)
    pool.allocate(1, 1)
    pool.free(1)
    with pytest.raises(ProtocolError, match="double free"):
        pool.free(1)
    with pytest.raises(ProtocolError, match="owns no pages"):
        pool.pages_of(1)


def test_exhaustion_names_the_numbers() -> None:
    pool = PagePool(4, 16, "decode0")
    pool.allocate(1, 48)
    assert not pool.can_allocate(32) and pool.fits_ever(64) and not pool.fits_ever(65)
    with pytest.raises(PoolExhausted, match="decode0: request 2 needs 2 pages, 1 free of 4"):
        pool.allocate(2, 17)
    assert pool.used_pages == 3  # a failed allocation takes nothing


def test_bad_pool_sizes() -> None:
    with pytest.raises(ConfigError):
        PagePool(0, 16)
    with pytest.raises(ConfigError):
        PagePool(4, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 9), st.integers(1, 70)), max_size=60))
def test_random_allocate_free_keeps_every_page_accounted(ops: list) -> None:
    pool = PagePool(16, 8)
    held: dict[int, int] = {}
    for alloc, owner, tokens in ops:
        if alloc and owner not in held and pool.can_allocate(tokens):
            held[owner] = len(pool.allocate(owner, tokens))
        elif not alloc and owner in held:
            assert pool.free(owner) == held.pop(owner)
        pool.check()
        assert pool.used_pages == sum(held.values())
    for owner in list(held):
        pool.free(owner)
    assert pool.free_pages == 16


def test_pages_for() -> None:
    assert [pages_for(t, 16) for t in (0, 1, 16, 17)] == [0, 1, 1, 2]


def test_hnd_and_nhd_offsets_match_flashinfer_shapes() -> None:
    hnd = PageLayout(page_size=4, heads=2, head_dim=8, elem_bytes=2, layout="HND")
    nhd = PageLayout(page_size=4, heads=2, head_dim=8, elem_bytes=2, layout="NHD")
    assert hnd.shape == (2, 2, 4, 8) and nhd.shape == (2, 4, 2, 8)
    assert hnd.page_bytes == nhd.page_bytes == 2 * 4 * 2 * 8 * 2
    # HND: [kv, head, token, dim]; V of head 1, token 3, dim 5
    assert hnd.offset(1, 1, 3, 5) == (((1 * 2 + 1) * 4 + 3) * 8 + 5) * 2
    # NHD: [kv, token, head, dim]
    assert nhd.offset(1, 1, 3, 5) == (((1 * 4 + 3) * 2 + 1) * 8 + 5) * 2
    # a head's tokens are contiguous in HND, interleaved with the other head in NHD
    assert hnd.offset(0, 1, 1) - hnd.offset(0, 1, 0) == 8 * 2
    assert nhd.offset(0, 1, 1) - nhd.offset(0, 1, 0) == 2 * 8 * 2


def test_mla_page() -> None:
    mla = PageLayout(page_size=4, heads=1, head_dim=576, elem_bytes=2, mla=True)
    assert mla.shape == (4, 576) and mla.page_bytes == 4 * 576 * 2
    assert mla.offset(0, 0, 2, 10) == (2 * 576 + 10) * 2
    with pytest.raises(ConfigError, match="MLA page has no head dimension"):
        PageLayout(page_size=4, heads=2, head_dim=576, mla=True)
    with pytest.raises(ConfigError, match="layout must be NHD or HND"):
        PageLayout(page_size=4, heads=1, head_dim=8, layout="HDN")  # type: ignore[arg-type]
