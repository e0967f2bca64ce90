"""Slot KV cache: each running request owns one slot of `max_seq_len` positions per layer.

Rolling a request back (rejected draft tokens, re-tokenised jump-forward text) is just moving
its length back: stale positions are overwritten by the next write and never read, because
attention only looks at positions below each request's length.
"""

from __future__ import annotations

import torch

from structgen.engine.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, max_seq_len: int, dtype: torch.dtype, device: torch.device):
        # One slot more than can be handed out: the scratch slot, where the padding rows of a
        # CUDA-graph batch write their K/V (never read by a real request).
        shape = (num_slots + 1, max_seq_len, cfg.num_key_value_heads, cfg.head_dim)
        # torch.empty: on CPU untouched pages cost no resident memory, so a generous cache is free.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.scratch_slot = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_hidden_layers * max_seq_len * cfg.num_key_value_heads * cfg.head_dim * elem

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        assert slot not in self._free, f"slot {slot} released twice"
        self._free.append(slot)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_put_((slots, positions), k)
        self.v[layer].index_put_((slots, positions), v)
