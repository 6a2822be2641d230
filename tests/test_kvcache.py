"""The page pool's invariants and the page byte layout."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.core.kvcache import Layout, PageLayout, PagePool, pages_for
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


def test_hnd_and_nhd_offsets_by_hand() -> None:
    hnd = PageLayout(page_size=4, heads=2, head_dim=8, elem_bytes=2, layout="HND")
    nhd = PageLayout(page_size=4, heads=2, head_dim=8, elem_bytes=2, layout="NHD")
    assert hnd.shape == (2, 2, 4, 8) and nhd.shape == (2, 4, 2, 8)
    assert hnd.page_bytes == nhd.page_bytes == 256  # 2 planes * 4 tokens * 2 heads * 8 * 2 B
    # V (plane 1), head 1, token 3, dim 5. HND [kv, head, token, dim]: V starts at element 64,
    # head 1 at +32, token 3 at +24, dim 5: element 125, byte 250
    assert hnd.offset(1, 1, 3, 5) == 250
    # NHD [kv, token, head, dim]: V at 64, token 3 at +48, head 1 at +8, dim 5: element 125 too
    assert nhd.offset(1, 1, 3, 5) == 250
    # they part elsewhere: K, head 1, token 0 is element 32 (byte 64) in HND, 8 (byte 16) in NHD
    assert hnd.offset(0, 1, 0) == 64 and nhd.offset(0, 1, 0) == 16
    # K, head 0, token 2, dim 1: HND 2 * 8 + 1 = 17 (byte 34); NHD 2 * 16 + 1 = 33 (byte 66)
    assert hnd.offset(0, 0, 2, 1) == 34 and nhd.offset(0, 0, 2, 1) == 66
    # a head's tokens are contiguous in HND, interleaved with the other head in NHD
    assert hnd.offset(0, 1, 1) - hnd.offset(0, 1, 0) == 16
    assert nhd.offset(0, 1, 1) - nhd.offset(0, 1, 0) == 32


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_every_element_of_a_page_has_its_own_aligned_offset(layout: Layout) -> None:
    page = PageLayout(page_size=4, heads=2, head_dim=8, elem_bytes=2, layout=layout)
    offsets = [
        page.offset(kv, head, token, dim)
        for kv in range(2)
        for head in range(2)
        for token in range(4)
        for dim in range(8)
    ]
    assert sorted(offsets) == list(range(0, 256, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_offsets_address_what_flashinfer_appends(layout: Layout) -> None:
    """FlashInfer's own append kernel writes K and V of two requests into a paged cache of its
    documented 5-D shape; every element it wrote sits at our byte offset."""
    torch = pytest.importorskip("torch")
    flashinfer = pytest.importorskip("flashinfer", reason="FlashInfer is not installed")
    if not torch.cuda.is_available():
        pytest.skip("FlashInfer's kernels need a CUDA GPU")
    page_size, heads, head_dim, num_pages = 4, 2, 128, 6
    page = PageLayout(page_size, heads, head_dim, elem_bytes=2, layout=layout)
    cuda = torch.device("cuda")
    shape = (num_pages, *page.shape)  # FlashInfer's [pages, 2, ...] for this layout
    cache = torch.zeros(shape, dtype=torch.float16, device=cuda)
    # request 0: 7 tokens on pages 3, 1 (3 in the last); request 1: 2 tokens on page 4
    pages = [[3, 1], [4]]
    lengths = [7, 2]
    i32 = {"dtype": torch.int32, "device": cuda}
    kv_indices = torch.tensor([3, 1, 4], **i32)
    kv_indptr = torch.tensor([0, 2, 3], **i32)
    last_page_len = torch.tensor([3, 2], **i32)
    append_indptr = torch.tensor([0, 7, 9], **i32)
    seq_lens = flashinfer.get_seq_lens(kv_indptr, last_page_len, page_size)
    batch_indices, positions = flashinfer.get_batch_indices_positions(append_indptr, seq_lens, 9)
    gen = torch.Generator(device=cuda).manual_seed(0)
    k = torch.randn(9, heads, head_dim, generator=gen, device=cuda).half()
    v = torch.randn(9, heads, head_dim, generator=gen, device=cuda).half()
    flashinfer.append_paged_kv_cache(
        k, v, batch_indices, positions, cache, kv_indices, kv_indptr, last_page_len, layout
    )
    torch.cuda.synchronize()
    flat = cache.flatten().cpu()
    row = 0
    for req, n in enumerate(lengths):
        for pos in range(n):
            page_id, slot = pages[req][pos // page_size], pos % page_size
            for kv, src in ((0, k), (1, v)):
                for head in range(heads):
                    base = page_id * page.page_bytes + page.offset(kv, head, slot)
                    got = flat[base // 2 : base // 2 + head_dim]
                    assert torch.equal(got, src[row, head].cpu()), (req, pos, kv, head)
            row += 1
    # and nothing else was written: 9 tokens x 2 planes x 2 heads x 128 values
    assert int((flat != 0).sum()) == int((k != 0).sum() + (v != 0).sum())


def test_mla_page() -> None:
    mla = PageLayout(page_size=4, heads=1, head_dim=576, elem_bytes=2, mla=True)
    assert mla.shape == (4, 576) and mla.page_bytes == 4 * 576 * 2
    assert mla.offset(0, 0, 2, 10) == (2 * 576 + 10) * 2
    with pytest.raises(ConfigError, match="MLA page has no head dimension"):
        PageLayout(page_size=4, heads=2, head_dim=576, mla=True)
    with pytest.raises(ConfigError, match="layout must be NHD or HND"):
        PageLayout(page_size=4, heads=1, head_dim=8, layout="HDN")  # type: ignore[arg-type]
