"""Paged KV cache: per layer, one pool of fixed-size pages of K and V.

Where a request's positions live is the page table's business (page_table.py): a token's K/V
go to its cache row, page * PAGE_SIZE + offset in the page (`AttentionBatch.token_slots`), and
attention reads a request's keys through its row of the table. Rolling a request back
(rejected draft tokens, re-tokenised jump-forward text) moves its length back and lets go of
the pages past it; stale positions in a kept page are overwritten by the next write and never
read, because attention only looks at positions below each request's length.
"""

from __future__ import annotations

import torch

from structgen.engine.config import ModelConfig
from structgen.engine.page_table import PageTable

PAGE_SIZE = 16  # tokens a page; also the granularity of prefix-cache hits


class KVCache:
    def __init__(self, cfg: ModelConfig, pages: PageTable, dtype: torch.dtype, device: torch.device):
        """One pool of `pages.num_pages` pages per layer; `pages` may be shared by several
        caches over the same requests (a draft model's cache beside the target's)."""
        shape = (pages.num_pages, pages.page_size, cfg.num_key_value_heads, cfg.head_dim)
        # torch.empty: on CPU untouched pages cost no resident memory, so a generous pool is free.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.pages = pages

    @property
    def num_slots(self) -> int:
        return self.pages.num_slots

    @property
    def scratch_slot(self) -> int:
        return self.pages.scratch_slot

    @property
    def max_seq_len(self) -> int:
        return self.pages.max_seq_len

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * page_size * cfg.num_key_value_heads * cfg.head_dim * elem

    def write(self, layer: int, token_slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """K/V of new tokens ([N, kv_heads, head_dim]) at their cache rows."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, token_slots, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, token_slots, v)
