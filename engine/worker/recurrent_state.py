"""A linear-attention layer's per-sequence state, kept in the paged KV cache's pages.

A linear-attention (recurrent) layer keeps no K/V per token: it keeps a fixed-size state
per sequence, a convolution state (the last `kernel - 1` inputs of its short causal
convolution) and a recurrent state (the gated delta rule's `[heads, k_dim, v_dim]`
matrix). Such a layer belongs to a RECURRENT KV cache group (`engine/kv/kv_cache_groups.py`)
and owns tensor pair j of the cache like any layer of its group: page b of its K tensor
holds a recurrent state, page b of its V tensor a convolution state, both float32 (the
bytes of a page are reinterpreted; `state_block_size` gives the smallest page that holds
them).

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
    `write` scatters states into pages. Any cache layout: `block_dim` is the dimension
    of the backend's `kv_cache_shape` that indexes blocks; a page is everything at one
    index of it (for a layout with heads first, one run per head)."""

    def __init__(
        self,
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x the backend's kv_cache_shape
        recurrent_shape: tuple[int, ...],  # e.g. (num_v_heads, head_k_dim, head_v_dim)
        conv_shape: tuple[int, ...],  # (conv_dim, kernel - 1)
        block_dim: int = 0,
    ) -> None:
        self.recurrent_shape, self.conv_shape = tuple(recurrent_shape), tuple(conv_shape)
        self._recurrent = _Pages(kv_cache[0], block_dim, math.prod(recurrent_shape), "recurrent")
        self._conv = _Pages(kv_cache[1], block_dim, math.prod(conv_shape), "convolution")

    def read(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """States of pages `blocks` ([n] int64): (conv [n, *conv_shape], recurrent
        [n, *recurrent_shape]), float32 copies."""
        n = blocks.shape[0]
        conv = self._conv.read(blocks).view(n, *self.conv_shape)
        recurrent = self._recurrent.read(blocks).view(n, *self.recurrent_shape)
        return conv, recurrent

    def write(self, blocks: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Stores states (as `read` returns them) into pages `blocks` ([n] int64, distinct)."""
        self._conv.write(blocks, conv)
        self._recurrent.write(blocks, recurrent)


class _Pages:
    """The pages of one cache tensor as rows of `numel` float32 (the first bytes of
    each page, in the page's own element order)."""

    def __init__(self, cache: torch.Tensor, block_dim: int, numel: int, what: str) -> None:
        self.pages = cache.movedim(block_dim, 0)  # [num_blocks, *page], a view
        self.page_shape = self.pages.shape[1:]
        self.page_bytes = math.prod(self.page_shape) * cache.element_size()
        self.numel = numel
        need = numel * STATE_DTYPE.itemsize
        if need > self.page_bytes:
            raise ValueError(
                f"a {what} state of {need} bytes does not fit a KV cache page of "
                f"{self.page_bytes} bytes; raise block_size"
            )

    def read(self, blocks: torch.Tensor) -> torch.Tensor:  # [n, numel] float32
        raw = self.pages.index_select(0, blocks).reshape(blocks.shape[0], -1).view(torch.uint8)
        return raw[:, : self.numel * STATE_DTYPE.itemsize].view(STATE_DTYPE)

    def write(self, blocks: torch.Tensor, state: torch.Tensor) -> None:
        n = blocks.shape[0]
        raw = torch.zeros(n, self.page_bytes, dtype=torch.uint8, device=self.pages.device)
        flat = state.reshape(n, -1).to(STATE_DTYPE).contiguous().view(torch.uint8)
        raw[:, : flat.shape[1]] = flat
        pages = raw.view(self.pages.dtype).view(n, *self.page_shape)
        self.pages.index_copy_(0, blocks, pages)


def state_block_size(
    state_bytes: int, kv_heads: int, head_size: int, dtype: torch.dtype, multiple: int = 16
) -> int:
    """The smallest block size (a multiple of `multiple` tokens) whose page of one K or V
    tensor, `block_size * kv_heads * head_size` elements of `dtype`, holds `state_bytes`."""
    per_token = kv_heads * head_size * dtype.itemsize
    return max(multiple, math.ceil(state_bytes / per_token / multiple) * multiple)
