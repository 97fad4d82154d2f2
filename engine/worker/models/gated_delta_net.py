"""Gated DeltaNet: the linear-attention layer of Qwen 3.5 (transformers' Qwen3_5GatedDeltaNet).

Per token: projections to the mixed q/k/v channels (`in_proj_qkv`), an output gate
(`in_proj_z`), a write strength beta (`in_proj_b`, sigmoid) and a decay g
(`in_proj_a`: g = -exp(A_log) * softplus(a + dt_bias)); a depthwise causal convolution
with SiLU over the mixed channels; q and k L2-normalized, q scaled by head_k_dim ** -0.5;
the gated delta rule over a per-sequence state S [value heads, k_dim, v_dim]

    S <- exp(g) * S;  S <- S + k (beta * (v - k^T S))^T;  out = q^T S

(each key head serves num_v_heads / num_k_heads consecutive value heads); a per-head
RMSNorm of the output gated by silu(z) (`norm`: plain weight, not zero-centered); `out_proj`.

The per-sequence state (the convolution's last kernel - 1 inputs and S) lives in the
layer's KV cache pages (`recurrent_state.py`'s contract): a step starts from page
`table[(c - 1) // block_size]` (zeros when c == 0, c = tokens computed before), and each
block the step's tokens fall in receives the state after its last such token. So a prefill
chunk runs the chunked rule block segment by block segment, carrying the state; decode
rows take one batched recurrent step. The rule runs in float32, as transformers' torch
fallbacks do (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`).
"""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import linear_attention_layers
from engine.worker.attention.metadata import AttentionMetadata
from engine.worker.parallel.group import TensorParallelGroup
from engine.worker.parallel.layers import (
    ColumnParallelLinear,
    Part,
    RowParallelLinear,
    check_shape,
    copy_parts,
)
from engine.worker.recurrent_state import STATE_DTYPE, RecurrentStatePages

CHUNK_SIZE = 64  # tokens per chunk of the chunked rule (transformers' default)
L2_EPS = 1e-6  # transformers' (and FLA's) l2norm epsilon


def is_linear_attention(hf_config, layer: int) -> bool:
    """Whether model layer `layer` is a Gated DeltaNet layer (`layer_types`)."""
    return layer in linear_attention_layers(hf_config)


def state_shapes(hf_config, world_size: int = 1) -> tuple[tuple[int, int, int], tuple[int, int]]:
    """One linear-attention layer's per-sequence state shapes on one of `world_size`
    tensor-parallel ranks (each holds its share of the heads): (recurrent
    (value heads, head_k_dim, head_v_dim), convolution (channels, kernel - 1))."""
    cfg = hf_config
    key_heads = cfg.linear_num_key_heads // world_size
    value_heads = cfg.linear_num_value_heads // world_size
    conv_dim = 2 * key_heads * cfg.linear_key_head_dim + value_heads * cfg.linear_value_head_dim
    recurrent = (value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    return recurrent, (conv_dim, cfg.linear_conv_kernel_dim - 1)


def head_shares(cfg, group: TensorParallelGroup) -> tuple[Part, Part, Part]:
    """This rank's share of the projections, as parts of their outputs: the queries' (and
    likewise the keys') channels, the values' channels, and the value heads. Key heads
    split evenly; each key head's value heads (consecutive) go with it."""
    k_start, k_end = group.shard(cfg.linear_num_key_heads, "linear_num_key_heads")
    repeat = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    keys = Part(cfg.linear_num_key_heads * dk, k_start * dk, (k_end - k_start) * dk)
    heads = Part(cfg.linear_num_value_heads, k_start * repeat, (k_end - k_start) * repeat)
    values = Part(heads.full * dv, heads.start * dv, heads.size * dv)
    return keys, values, heads


class DepthwiseConv1d(nn.Module):
    """The short convolution's weight [this rank's channels, 1, kernel]: `load` keeps
    this rank's rows of each of `parts` (the q, k and v channels) of the checkpoint's."""

    def __init__(self, parts: tuple[Part, ...], kernel: int) -> None:
        super().__init__()
        self.parts = parts
        self.weight = nn.Parameter(torch.empty(sum(p.size for p in parts), 1, kernel))

    def load(self, name: str, tensor: torch.Tensor, part: int | None = None) -> None:
        copy_parts(self.weight, tensor, self.parts, dim=0)


class RMSNormGated(nn.Module):
    """Per-head RMSNorm times weight, then times silu(gate) (transformers'
    Qwen3_5RMSNormGated): normalized in float32, rounded to x's dtype before the weight,
    gated in float32, rounded once more."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [N, size] each
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Model layer `layer_index`'s Gated DeltaNet (see the module docstring):
    `forward(positions, hidden [T, hidden_size], kv_cache, metadata) -> [T, hidden_size]`,
    `kv_cache` this layer's (K, V) pages, holding (recurrent, convolution) states.
    Parameters carry transformers' names. Under tensor parallelism each rank holds its
    share of the key heads (`head_shares`) with their value heads, their channels of
    the convolution and their part of the state; `out_proj` sums the ranks' parts."""

    def __init__(
        self,
        cfg,
        layer_index: int,
        group: TensorParallelGroup | None = None,
        block_dim: int = 0,
    ) -> None:
        """`block_dim`: the dimension of the attention backend's cache layout that
        indexes blocks (the pages hold this layer's states)."""
        super().__init__()
        group = group or TensorParallelGroup()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (silu)")
        self.block_dim, self.layer_index = block_dim, layer_index
        keys, values, heads = head_shares(cfg, group)
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.num_k_heads, self.num_v_heads = keys.size // self.head_k_dim, heads.size
        self.key_dim, self.value_dim = keys.size, values.size
        self.first_v_head, self.total_v_heads = heads.start, heads.full
        self.recurrent_shape, self.conv_shape = state_shapes(cfg, group.world_size)
        hidden = cfg.hidden_size
        self.conv1d = DepthwiseConv1d((keys, keys, values), cfg.linear_conv_kernel_dim)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = RMSNormGated(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(values.full, hidden, False, group)
        self.in_proj_qkv = ColumnParallelLinear(hidden, (keys, keys, values), False, group)
        self.in_proj_z = ColumnParallelLinear(hidden, (values,), False, group)
        self.in_proj_b = ColumnParallelLinear(hidden, (heads,), False, group)
        self.in_proj_a = ColumnParallelLinear(hidden, (heads,), False, group)

    def load(self, name: str, tensor: torch.Tensor, part: int | None = None) -> None:
        """`dt_bias`, `A_log` [all value heads]: this rank's heads'."""
        param = getattr(self, name)
        check_shape(tensor, (self.total_v_heads,))
        with torch.no_grad():
            param.copy_(tensor.narrow(0, self.first_v_head, self.num_v_heads))

    def forward(
        self,
        positions: torch.Tensor,  # [T] (unused: the state carries the order)
        hidden: torch.Tensor,  # [T, hidden_size]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        md = metadata.for_layer(self.layer_index)
        if md.block_size <= 0:
            raise ValueError("Gated DeltaNet layers need the metadata's block_size")
        shapes = (self.recurrent_shape, self.conv_shape)
        pages = RecurrentStatePages(kv_cache, *shapes, block_dim=self.block_dim)
        mixed = self.in_proj_qkv(hidden)  # [T, conv_dim], before the convolution
        beta = self.in_proj_b(hidden).sigmoid()  # [T, num_v_heads]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden).float() + self.dt_bias)
        core = hidden.new_zeros(hidden.shape[0], self.num_v_heads, self.head_v_dim)
        starts = (0, *accumulate(md.query_lens_cpu))
        d = md.num_decodes
        if d:
            core[: starts[d]] = self._decode(mixed[: starts[d]], beta[:d], g[:d], pages, md)
        for row in range(d, md.num_seqs):
            rows = slice(starts[row], starts[row + 1])
            core[rows] = self._prefill(row, mixed[rows], beta[rows], g[rows], pages, md)
        z = self.in_proj_z(hidden).view(-1, self.head_v_dim)  # [T * num_v_heads, head_v_dim]
        out = self.norm(core.view(-1, self.head_v_dim), z)
        return self.out_proj(out.view(hidden.shape[0], self.value_dim))

    def _decode(self, mixed, beta, g, pages: RecurrentStatePages, md) -> torch.Tensor:
        """One token for each of the first `len(mixed)` rows (mixed [n, conv_dim], beta and
        g [n, num_v_heads]), one batched step: [n, num_v_heads, head_v_dim]."""
        n, bs = mixed.shape[0], md.block_size
        computed = [s - 1 for s in md.seq_lens_cpu[:n]]
        conv, state = self._read(pages, md, range(n), computed)
        window = torch.cat([conv.to(mixed.dtype), mixed.unsqueeze(-1)], dim=-1)  # [n, C, K]
        q, k, v = self._split_heads(self._convolve(window).squeeze(-1))
        out, state = gated_delta_step(q, k, v, g, beta.float(), state)
        blocks = self._blocks(md, range(n), [c // bs for c in computed])
        pages.write(blocks, window[..., 1:], state)
        return out.to(mixed.dtype)

    def _prefill(self, row: int, mixed, beta, g, pages: RecurrentStatePages, md) -> torch.Tensor:
        """Row `row`'s chunk (mixed [L, conv_dim], beta and g [L, num_v_heads]) segment by
        block, each block's last state written to its page: [L, num_v_heads, head_v_dim]."""
        length, bs = mixed.shape[0], md.block_size
        first = md.seq_lens_cpu[row] - length  # tokens computed before this step
        conv, state = self._read(pages, md, [row], [first])
        inputs = torch.cat([conv[0].to(mixed.dtype), mixed.t()], dim=-1)  # [C, K - 1 + L]
        q, k, v = self._split_heads(self._convolve(inputs[None])[0].t())  # [L, heads, dim]
        beta, state = beta.float(), state[0]
        ends = [*range((first // bs + 1) * bs, first + length, bs), first + length]
        outs, states, convs, start = [], [], [], first
        for end in ends:  # each segment [start, end) within one block
            seg = slice(start - first, end - first)
            out, state = chunked_gated_delta_rule(q[seg], k[seg], v[seg], g[seg], beta[seg], state)
            outs.append(out)
            states.append(state)
            convs.append(inputs[:, end - first : end - first + self.conv_shape[1]])
            start = end
        blocks = self._blocks(md, [row] * len(ends), [(e - 1) // bs for e in ends])
        pages.write(blocks, torch.stack(convs), torch.stack(states))
        return torch.cat(outs).to(mixed.dtype)

    def _read(self, pages, md, rows, computed: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Starting states of `rows` whose sequences have `computed` tokens before this
        step: their last page's, zeros where none (conv [n, C, K - 1], recurrent [n, ...])."""
        n, device = len(computed), md.block_tables.device
        conv = torch.zeros(n, *self.conv_shape, dtype=STATE_DTYPE, device=device)
        recurrent = torch.zeros(n, *self.recurrent_shape, dtype=STATE_DTYPE, device=device)
        have = [i for i, c in enumerate(computed) if c > 0]
        if have:
            cols = [(computed[i] - 1) // md.block_size for i in have]
            blocks = self._blocks(md, [rows[i] for i in have], cols)
            idx = torch.tensor(have, device=device)
            conv[idx], recurrent[idx] = pages.read(blocks)
        return conv, recurrent

    @staticmethod
    def _blocks(md, rows, cols: list[int]) -> torch.Tensor:  # [n] page ids, int64
        device = md.block_tables.device
        rows_t = torch.tensor(list(rows), dtype=torch.int64, device=device)
        return md.block_tables[rows_t, torch.tensor(cols, dtype=torch.int64, device=device)]

    def _convolve(self, inputs: torch.Tensor) -> torch.Tensor:
        """Depthwise causal convolution and SiLU: [..., C, K - 1 + L] -> [..., C, L]
        (the first K - 1 inputs are the previous ones, zeros before the sequence)."""
        weight = self.conv1d.weight  # [C, 1, K]
        out = F.conv1d(inputs.to(weight.dtype), weight, groups=weight.shape[0])
        return F.silu(out).to(inputs.dtype)

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Convolved [N, conv_dim] -> float32 q, k [N, num_v_heads, head_k_dim] (normalized,
        each key head repeated for its value heads, q scaled) and v [N, num_v_heads,
        head_v_dim]."""
        n, repeat = mixed.shape[0], self.num_v_heads // self.num_k_heads
        q, k, v = mixed.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (
            _l2_normalize(x.reshape(n, self.num_k_heads, self.head_k_dim)).repeat_interleave(
                repeat, dim=1
            )
            for x in (q, k)
        )
        return q * self.head_k_dim**-0.5, k, v.reshape(n, self.num_v_heads, self.head_v_dim)


def _l2_normalize(x: torch.Tensor) -> torch.Tensor:  # [..., dim], float32
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def gated_delta_step(
    q: torch.Tensor,  # [n, H, Dk] float32 (normalized, scaled)
    k: torch.Tensor,  # [n, H, Dk]
    v: torch.Tensor,  # [n, H, Dv]
    g: torch.Tensor,  # [n, H] log decay
    beta: torch.Tensor,  # [n, H]
    state: torch.Tensor,  # [n, H, Dk, Dv]
) -> tuple[torch.Tensor, torch.Tensor]:  # (out [n, H, Dv], state [n, H, Dk, Dv])
    """One token of the gated delta rule for each of n sequences."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k.unsqueeze(-1)).sum(dim=-2)  # [n, H, Dv]: what S predicts for k
    delta = (v - remembered) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(dim=-2), state


def chunked_gated_delta_rule(
    q: torch.Tensor,  # [L, H, Dk] float32 (normalized, scaled)
    k: torch.Tensor,  # [L, H, Dk]
    v: torch.Tensor,  # [L, H, Dv]
    g: torch.Tensor,  # [L, H] log decay
    beta: torch.Tensor,  # [L, H]
    state: torch.Tensor,  # [H, Dk, Dv], the state before the first token
) -> tuple[torch.Tensor, torch.Tensor]:  # (out [L, H, Dv], state after the last token)
    """The gated delta rule over L tokens of one sequence, chunk by chunk (the WY form:
    within a chunk the updates are one triangular solve, between chunks the state carries).
    Zero padding to whole chunks leaves the state alone (k = 0, beta = 0, g = 0)."""
    length = q.shape[0]
    chunk = min(CHUNK_SIZE, length)
    pad = -length % chunk
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, L', D]
    g, beta = (F.pad(x.t(), (0, pad)) for x in (g, beta))  # [H, L']
    heads = q.shape[0]
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (
        x.reshape(heads, -1, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta)
    )
    g = g.reshape(heads, -1, chunk).cumsum(-1)  # [H, N, C]: log decay from the chunk start
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # [H, N, C, C], unit lower triangular
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * g.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * decay  # [H, N, C, C]
    q_decayed = q * g.exp().unsqueeze(-1)
    k_decayed = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    chunk_decay = g[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    out = torch.empty_like(u)  # [H, N, C, Dv]
    for i in range(g.shape[1]):
        v_new = u[:, i] - w[:, i] @ state  # [H, C, Dv]
        out[:, i] = q_decayed[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k_decayed[:, i].transpose(-1, -2) @ v_new
    return out.reshape(heads, -1, out.shape[-1])[:, :length].transpose(0, 1), state
