"""Page hashes for prefix caching: a full page is named by its tokens and everything before it.

vLLM's scheme (v1 kv_cache_utils.hash_block_tokens): the hash of page i covers the hash of page
i - 1 and page i's tokens, so equal hashes mean equal prefixes, whole, not just equal pages.
BLAKE2b (128-bit digests) rather than Python's hash(): a collision would hand a row another
prompt's K/V without a trace, so it must be out of reach, and it costs ~1 us a page.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Optional

PageHash = bytes


def page_hash(parent: Optional[PageHash], tokens: list[int]) -> PageHash:
    """A full page's hash: its tokens chained onto its parent page's hash, so equal hashes mean equal prefixes."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def extend_hashes(hashes: list[PageHash], tokens: list[int], page_size: int, full_pages: int,
                  root: Optional[PageHash] = None) -> list[PageHash]:
    """`hashes` (of tokens' first pages) extended in place to the first `full_pages` full pages of tokens;
    `root`: the first page's parent (what else the K/V depends on: equal tokens under another root never
    share a page)."""
    while len(hashes) < full_pages:
        i = len(hashes)
        hashes.append(page_hash(hashes[-1] if hashes else root, tokens[i * page_size:(i + 1) * page_size]))
    return hashes
