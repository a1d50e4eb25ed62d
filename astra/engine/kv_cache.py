"""The key/value cache of one batch of sequences, and how one forward uses it.

`KVCache` holds, per layer, keys and values as [slots, kv_heads, positions,
head_dim]; row `i` belongs to the i-th running sequence of the batch (the
scheduler keeps rows compact: a finished sequence's row is refilled by
`move`). Both dimensions grow by doubling, so memory follows what is used.

`CacheStep` tells attention what one forward does with the cache:
- prefill (`pos_B` None): rows slot0..slot0+B-1 are new sequences; their
  prompts, right-padded to T, are written at positions 0..T-1 and attention is
  plain causal over the fresh keys (a padded row's real tokens never see its
  pads, which sit to their right; the pads' entries are overwritten later);
- decode (`pos_B` given): rows 0..B-1 each add one token at their own position
  and attend to positions 0..pos of their own row; entries past pos are masked.

Legend: B batch rows, K kv heads, H query heads, T new positions, L cached
positions attended to, d head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def _grown(size: int, need: int) -> int:
    while size < need:
        size *= 2
    return size


class KVCache:
    """Keys and values of every layer for a growable number of rows and positions."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        rows: int = 4,
        positions: int = 64,
    ) -> None:
        shape = (rows, num_kv_heads, positions, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def rows(self) -> int:
        return self.k[0].shape[0]

    @property
    def positions(self) -> int:
        return self.k[0].shape[2]

    def reserve(self, rows: int, positions: int) -> None:
        """Grows (never shrinks) to hold `rows` sequences of `positions` tokens each."""
        if rows <= self.rows and positions <= self.positions:
            return
        new_rows, new_pos = _grown(self.rows, rows), _grown(self.positions, positions)
        for cache in (self.k, self.v):
            for i, old in enumerate(cache):
                new = old.new_zeros((new_rows, old.shape[1], new_pos, old.shape[3]))
                new[: old.shape[0], :, : old.shape[2]] = old
                cache[i] = new

    def move(self, src: int, dst: int, length: int) -> None:
        """Copies row src's first `length` positions into row dst (compaction)."""
        for cache in (self.k, self.v):
            for layer in cache:
                layer[dst, :, :length] = layer[src, :, :length]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


@dataclass
class CacheStep:
    """One forward's use of the cache: prefill of new rows, or one decode position per row."""

    cache: KVCache
    slot0: int = 0
    pos_B: Tensor | None = None  # decode only: each row's position of the new token
    mask_B11L: Tensor | None = None  # decode only: key position <= row position

    @classmethod
    def prefill(cls, cache: KVCache, slot0: int, rows: int, length: int) -> CacheStep:
        cache.reserve(slot0 + rows, length)
        return cls(cache, slot0)

    @classmethod
    def decode(cls, cache: KVCache, pos_B: Tensor) -> CacheStep:
        length = int(pos_B.max()) + 1
        cache.reserve(pos_B.shape[0], length)
        mask_B11L = torch.arange(length, device=pos_B.device) <= pos_B[:, None]
        return cls(cache, 0, pos_B, mask_B11L[:, None, None, :])

    def attend(self, layer: int, q_BHTd: Tensor, k_BKTd: Tensor, v_BKTd: Tensor) -> Tensor:
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        B, _, T, _ = k_BKTd.shape
        if self.pos_B is None:
            k_cache[self.slot0 : self.slot0 + B, :, :T] = k_BKTd
            v_cache[self.slot0 : self.slot0 + B, :, :T] = v_BKTd
            return F.scaled_dot_product_attention(
                q_BHTd, k_BKTd, v_BKTd, is_causal=True, enable_gqa=True
            )
        rows_B = torch.arange(B, device=self.pos_B.device)
        k_cache[rows_B, :, self.pos_B] = k_BKTd[:, :, 0]
        v_cache[rows_B, :, self.pos_B] = v_BKTd[:, :, 0]
        assert self.mask_B11L is not None
        L = self.mask_B11L.shape[-1]
        return F.scaled_dot_product_attention(
            q_BHTd,
            k_cache[:B, :, :L],
            v_cache[:B, :, :L],
            attn_mask=self.mask_B11L,
            enable_gqa=True,
        )
