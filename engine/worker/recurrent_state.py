"""A linear-attention layer's per-sequence state, kept in the paged KV cache's pages.

A linear-attention (recurrent) layer keeps no K/V per token: it keeps a fixed-size state
per sequence, a convolution state (the last `kernel - 1` inputs of its short causal
convolution) and a recurrent state (the gated delta rule's `[heads, k_dim, v_dim]`
matrix). Such a layer belongs to a RECURRENT KV cache group (`engine/kv/kv_cache_groups.py`)
and owns tensor pair j of the cache like any layer of its group: page b of its K tensor
and page b of its V tensor together hold one state, float32 (the pages' bytes are
reinterpreted; `state_block_size` gives the smallest pages that hold it).

Which page holds what (the contract between the allocator and the layer): after a step,
for every block b of the group's table that the step's tokens fall in, page b holds the
state after the last of the step's tokens in block b. So a full block holds the state
at its end, which is what prefix caching reuses, and the next step of a sequence whose
first new token is at position c reads the state of page `table[(c - 1) // block_size]`
(zeros when c == 0). The allocator keeps exactly the blocks from that one on (a window
of two tokens in block arithmetic) and never gives a step a page another sequence still
reads without copying it first (copy-on-write covers the state like K/V).
"""

from __future__ import annotations

import math

import torch

STATE_DTYPE = torch.float32


class RecurrentStatePages:
    """One layer's cache pages seen as states: `read` gathers states of some pages,
    `write` scatters states into pages. Page b of the layer is page b of its K tensor
    followed by page b of its V tensor, read as bytes: the convolution state, then the
    recurrent state. Any cache layout: `block_dim` is the dimension of the backend's
    `kv_cache_shape` that indexes blocks (a layout with heads first has one run per head
    in a page; the bytes are taken in the page's own element order)."""

    def __init__(
        self,
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x the backend's kv_cache_shape
        recurrent_shape: tuple[int, ...],  # e.g. (num_v_heads, head_k_dim, head_v_dim)
        conv_shape: tuple[int, ...],  # (conv_dim, kernel - 1)
        block_dim: int = 0,
    ) -> None:
        self.recurrent_shape, self.conv_shape = tuple(recurrent_shape), tuple(conv_shape)
        self._conv_numel = math.prod(conv_shape)
        self._numel = self._conv_numel + math.prod(recurrent_shape)
        self._pages = tuple(cache.movedim(block_dim, 0) for cache in kv_cache)  # views
        self._page_bytes = tuple(math.prod(p.shape[1:]) * p.element_size() for p in self._pages)
        need = self._numel * STATE_DTYPE.itemsize
        if need > sum(self._page_bytes):
            raise ValueError(
                f"a linear-attention state of {need} bytes does not fit a layer's K and V "
                f"pages of {sum(self._page_bytes)} bytes; raise block_size"
            )

    def read(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """States of pages `blocks` ([n] int64): (conv [n, *conv_shape], recurrent
        [n, *recurrent_shape]), float32 copies."""
        n = blocks.shape[0]
        raw = torch.cat(
            [p.index_select(0, blocks).reshape(n, -1).view(torch.uint8) for p in self._pages],
            dim=1,
        )  # [n, K page bytes + V page bytes]
        state = raw[:, : self._numel * STATE_DTYPE.itemsize].view(STATE_DTYPE)
        conv = state[:, : self._conv_numel].reshape(n, *self.conv_shape)
        return conv, state[:, self._conv_numel :].reshape(n, *self.recurrent_shape)

    def write(self, blocks: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Stores states (as `read` returns them) into pages `blocks` ([n] int64, distinct)."""
        n = blocks.shape[0]
        raw = torch.zeros(n, sum(self._page_bytes), dtype=torch.uint8, device=blocks.device)
        state = torch.cat([conv.reshape(n, -1), recurrent.reshape(n, -1)], dim=1)
        flat = state.to(STATE_DTYPE).contiguous().view(torch.uint8)
        raw[:, : flat.shape[1]] = flat
        for pages, part in zip(self._pages, raw.split(self._page_bytes, dim=1), strict=True):
            page = part.contiguous().view(pages.dtype).view(n, *pages.shape[1:])
            pages.index_copy_(0, blocks, page)


def state_block_size(
    state_bytes: int, kv_heads: int, head_size: int, dtype: torch.dtype, multiple: int = 16
) -> int:
    """The smallest block size (a multiple of `multiple` tokens) whose K and V pages,
    `2 * block_size * kv_heads * head_size` elements of `dtype`, hold `state_bytes`."""
    per_token = 2 * kv_heads * head_size * dtype.itemsize
    return max(multiple, math.ceil(state_bytes / per_token / multiple) * multiple)
