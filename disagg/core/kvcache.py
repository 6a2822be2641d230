"""Paged KV cache: the page pool (who owns which page) and the byte layout of one page.

A page holds `page_size` consecutive tokens of one request, for every layer: page id p of layer
l lives at `layer_base[l] + p * page_bytes` in that layer's cache tensor (one tensor per layer,
as FlashInfer's paged wrappers take them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from disagg.errors import ConfigError, PoolExhausted, ProtocolError

Layout = Literal["NHD", "HND"]


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed to hold `tokens` tokens."""
    return -(-tokens // page_size)


class PagePool:
    """A fixed set of page ids handed to owners (request ids); nothing is evicted.

    Every page is either free or owned by exactly one owner. `reserve` marks an owner's pages
    non-evictable (the decode side's reservation); `allocate` gives ordinary pages. Neither kind
    is ever reclaimed behind an owner's back: pages come back only through `free`.
    """

    def __init__(self, num_pages: int, page_size: int, name: str = "pool") -> None:
        if num_pages < 1:
            raise ConfigError(f"{name}: a page pool needs at least one page, got {num_pages}")
        if page_size < 1:
            raise ConfigError(f"{name}: page_size must be >= 1, got {page_size}")
        self.name = name
        self.num_pages = num_pages
        self.page_size = page_size
        # Pages never handed out are ids >= _fresh (a pool may hold millions: no list of them);
        # returned pages wait on a stack. Lowest ids first out: deterministic, cache friendly.
        self._fresh = 0
        self._free: list[int] = []
        self._owned: dict[int, list[int]] = {}
        self._pinned: set[int] = set()

    @property
    def free_pages(self) -> int:
        return len(self._free) + self.num_pages - self._fresh

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.free_pages

    @property
    def owners(self) -> list[int]:
        return list(self._owned)

    def pages_for(self, tokens: int) -> int:
        return pages_for(tokens, self.page_size)

    def fits_ever(self, tokens: int) -> bool:
        """Whether `tokens` could fit in this pool when it is empty."""
        return -(-tokens // self.page_size) <= self.num_pages

    def can_allocate(self, tokens: int) -> bool:
        return -(-tokens // self.page_size) <= len(self._free) + self.num_pages - self._fresh

    def allocate(self, owner: int, tokens: int, *, pinned: bool = False) -> list[int]:
        """Give `owner` the pages for `tokens` more tokens; returns the new page ids."""
        n = -(-tokens // self.page_size)
        free = self._free
        if n > len(free) + self.num_pages - self._fresh:
            raise PoolExhausted(
                f"{self.name}: request {owner} needs {n} pages, {self.free_pages} free "
                f"of {self.num_pages}"
            )
        cut = max(len(free) - n, 0)  # freed pages are reused last freed first
        pages = free[cut:]
        pages.reverse()
        del free[cut:]
        fresh = n - len(pages)  # the rest: pages never handed out yet
        if fresh:
            pages += range(self._fresh, self._fresh + fresh)
            self._fresh += fresh
        owned = self._owned.get(owner)
        if owned is None:
            self._owned[owner] = pages.copy()
        else:
            owned.extend(pages)
        if pinned:
            self._pinned.add(owner)
        return pages

    def reserve(self, owner: int, tokens: int) -> list[int]:
        """Allocate non-evictable pages: what the decode side holds for an incoming request."""
        return self.allocate(owner, tokens, pinned=True)

    def is_pinned(self, owner: int) -> bool:
        return owner in self._pinned

    def pages_of(self, owner: int) -> list[int]:
        if owner not in self._owned:
            raise ProtocolError(f"{self.name}: request {owner} owns no pages")
        return list(self._owned[owner])

    def free(self, owner: int) -> int:
        """Return all of `owner`'s pages; a second free of the same owner is an error."""
        pages = self._owned.pop(owner, None)
        if pages is None:
            raise ProtocolError(f"{self.name}: double free (request {owner} owns no pages)")
        self._pinned.discard(owner)
        self._free.extend(reversed(pages))
        return len(pages)

    def check(self) -> None:
        """Raise ProtocolError if any page is lost, duplicated or owned twice."""
        owned = [p for pages in self._owned.values() for p in pages]
        every = owned + self._free
        if len(every) != self._fresh or set(every) != set(range(self._fresh)):
            raise ProtocolError(
                f"{self.name}: page accounting broken: {len(owned)} owned + {len(self._free)} "
                f"returned != {self._fresh} handed out, or a page is held twice"
            )


@dataclass(frozen=True)
class PageLayout:
    """Byte layout of one page of one layer on one rank, as FlashInfer stores it.

    GQA: `[2, page_size, heads, head_dim]` (NHD) or `[2, heads, page_size, head_dim]` (HND),
    K first then V. MLA: `[page_size, latent_dim]`, one row per token (the compressed latent
    followed by the rope key), no head dimension and no separate V.
    `heads` is the number of KV heads this rank holds.
    """

    page_size: int
    heads: int
    head_dim: int
    elem_bytes: int = 2
    layout: Layout = "HND"
    mla: bool = False

    def __post_init__(self) -> None:
        if self.layout not in ("NHD", "HND"):
            raise ConfigError(f"layout must be NHD or HND, got {self.layout!r}")
        for field in ("page_size", "heads", "head_dim", "elem_bytes"):
            if getattr(self, field) < 1:
                raise ConfigError(f"PageLayout.{field} must be >= 1, got {getattr(self, field)}")
        if self.mla and self.heads != 1:
            raise ConfigError("an MLA page has no head dimension: heads must be 1")

    @property
    def kv_planes(self) -> int:
        return 1 if self.mla else 2

    @property
    def page_elems(self) -> int:
        return self.kv_planes * self.page_size * self.heads * self.head_dim

    @property
    def page_bytes(self) -> int:
        return self.page_elems * self.elem_bytes

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of one page (without the leading page dimension)."""
        if self.mla:
            return (self.page_size, self.head_dim)
        if self.layout == "NHD":
            return (2, self.page_size, self.heads, self.head_dim)
        return (2, self.heads, self.page_size, self.head_dim)

    def offset(self, kv: int, head: int, token: int, dim: int = 0) -> int:
        """Byte offset of element (kv, head, token, dim) inside the page."""
        if self.mla:
            idx = token * self.head_dim + dim
        elif self.layout == "NHD":
            idx = ((kv * self.page_size + token) * self.heads + head) * self.head_dim + dim
        else:
            idx = ((kv * self.heads + head) * self.page_size + token) * self.head_dim + dim
        return idx * self.elem_bytes
