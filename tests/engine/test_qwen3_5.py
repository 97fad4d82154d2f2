"""Qwen 3.5 and Qwen3-Next (Gated DeltaNet and gated full attention) against
transformers, run directly.

Our model class (the registry's for the HF class: `Qwen3_5ForCausalLM`,
`Qwen3NextForCausalLM`) gets the tiny random HF model's weights and paged per-layer
caches whose block size holds a linear-attention layer's state; each case compares
logits with HF's full-sequence forward (float32): a whole prompt in one step; several
sequences fed in chunks that cross block boundaries beside decode rows, with the
linear layers' tables holding the null page before the block they read; a prefix-cache
hit restarting from a full block's state; a copied (copy-on-write) page carrying it.
"""

from __future__ import annotations

import functools
import math
from itertools import accumulate

import pytest
import torch

from engine.config import linear_attention_state_bytes
from engine.worker.attention import (
    AttentionMetadata,
    ReferenceBackend,
    SdpaBackend,
)
from engine.worker.attention.metadata import GroupedAttentionMetadata
from engine.worker.models.base import CausalLM
from engine.worker.models.gated_delta_net import (
    GatedDeltaNet,
    is_linear_attention,
    state_shapes,
)
from engine.worker.models.qwen3_5 import Qwen3_5ForCausalLM
from engine.worker.models.registry import resolve_model_class
from engine.worker.parallel.group import TensorParallelGroup
from engine.worker.recurrent_state import state_block_size
from tests.engine.native_backend import native_backend
from tests.engine.tiny_models import VOCAB, build_hf_model

ATOL = 1e-4
NUM_BLOCKS = 16  # page 0 is the null page: no table below uses it
BACKENDS = {"reference": ReferenceBackend, "sdpa": SdpaBackend, "native": native_backend}
HYBRIDS = ("qwen3.5", "qwen3-next")  # tiny_models' names: DeltaNet and attention layers


@pytest.fixture(params=HYBRIDS)
def arch(request) -> str:
    return request.param


@functools.cache
def hf_model(arch: str) -> torch.nn.Module:
    return build_hf_model(arch)


def config(arch: str):
    return hf_model(arch).config


@functools.cache
def block_size(arch: str) -> int:
    cfg = config(arch)
    state = sum(linear_attention_state_bytes(cfg))
    return state_block_size(state, cfg.num_key_value_heads, cfg.head_dim, torch.float32)


@functools.cache
def hf_logits(arch: str, tokens: tuple[int, ...]) -> torch.Tensor:  # [T, vocab]
    with torch.no_grad():
        return hf_model(arch)(torch.tensor([tokens])).logits[0].float()


def model_class(arch: str) -> type[CausalLM]:
    return resolve_model_class(type(hf_model(arch)).__name__)


def our_model(arch: str, backend: str = "reference") -> CausalLM:
    model = model_class(arch)(config(arch), BACKENDS[backend]())
    model.load_weights(hf_model(arch).state_dict().items())
    return model.eval()


def backend_of(model):
    return next(m.attn.backend for m in model.modules() if hasattr(m, "attn"))


def make_kv_caches(arch: str, model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, a (K, V) pair in its backend's layout (SDPA's puts heads first: the
    linear layers' pages are then one run per head). The linear layers' null page is
    NaN, so a read of it would show in the logits and a write of it in the page."""
    cfg = config(arch)
    backend = backend_of(model)
    sizes = (NUM_BLOCKS, block_size(arch), cfg.num_key_value_heads, cfg.head_dim)
    caches = []
    for layer in range(cfg.num_hidden_layers):
        pair = tuple(torch.zeros(backend.kv_cache_shape(*sizes)) for _ in "kv")
        if is_linear_attention(cfg, layer):
            for t in pair:
                t.select(backend.block_dim, 0).fill_(float("nan"))
        caches.append(pair)
    return caches


def null_page_untouched(arch: str, caches, block_dim: int = 0) -> bool:
    cfg = config(arch)
    return all(
        bool(t.select(block_dim, 0).isnan().all())
        for layer, pair in enumerate(caches)
        if is_linear_attention(cfg, layer)
        for t in pair
    )


def make_metadata(arch: str, rows, free_early_blocks: bool = False):
    """Metadata and positions for rows `(table, first_position, num_new_tokens)`,
    decodes first. `free_early_blocks`: the linear layers get their own group whose
    tables hold the null page before the block their state is read from."""
    bs = block_size(arch)
    query_lens = tuple(n for _, _, n in rows)
    seq_lens = tuple(start + n for _, start, n in rows)
    num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(rows))
    assert all(n != 1 for n in query_lens[num_decodes:]), "decode rows must come first"
    tables = torch.zeros(len(rows), max(len(t) for t, _, _ in rows), dtype=torch.int64)
    for i, (table, _, _) in enumerate(rows):
        tables[i, : len(table)] = torch.tensor(table)
    positions = torch.cat([torch.arange(start, start + n) for _, start, n in rows])
    rows_of_tokens = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(query_lens))
    slots = tables[rows_of_tokens, positions // bs] * bs + positions % bs

    def metadata(block_tables):
        return AttentionMetadata(
            query_start_loc=torch.tensor((0, *accumulate(query_lens))),
            seq_lens=torch.tensor(seq_lens),
            block_tables=block_tables,
            slot_mapping=slots,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            num_decodes=num_decodes,
            block_size=bs,
        )

    if not free_early_blocks:
        return metadata(tables), positions
    linear_tables = tables.clone()
    for i, (_, start, _) in enumerate(rows):
        linear_tables[i, : max(0, (start - 1) // bs)] = 0
    groups = (metadata(tables), metadata(linear_tables))
    cfg = config(arch)
    kinds = tuple(int(is_linear_attention(cfg, i)) for i in range(cfg.num_hidden_layers))
    return GroupedAttentionMetadata(groups, kinds), positions


def run_step(arch, model, caches, rows, tokens, free_early_blocks=False) -> torch.Tensor:
    """Logits [num new tokens, vocab] of one step; rows `(name, table, start, n)`."""
    metadata, positions = make_metadata(arch, [r[1:] for r in rows], free_early_blocks)
    ids = torch.tensor([t for name, _, start, n in rows for t in tokens[name][start : start + n]])
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, caches, metadata))


def check_rows(arch: str, logits, rows, tokens) -> None:
    offset = 0
    for name, _, start, n in rows:
        expected = hf_logits(arch, tokens[name])[start : start + n]
        got = logits[offset : offset + n]
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=f"{name}@{start}")
        offset += n


def random_tokens(n: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, VOCAB, (n,), generator=g).tolist())


def shuffled_blocks(seed: int) -> list[int]:
    """Every page but the null page, shuffled."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(NUM_BLOCKS - 1, generator=g) + 1).tolist()


def test_the_config_is_a_hybrid_with_multi_block_sequences(arch: str) -> None:
    cfg = config(arch)
    assert [is_linear_attention(cfg, i) for i in range(4)] == [True, True, True, False]
    assert block_size(arch) == 32  # the 4 KiB recurrent state over 128 bytes a token
    recurrent, conv = state_shapes(cfg)
    assert linear_attention_state_bytes(cfg) == (4 * math.prod(recurrent), 4 * math.prod(conv))


@pytest.mark.parametrize("backend", BACKENDS)
def test_whole_prompt_matches_hf(arch: str, backend: str) -> None:
    tokens = {"a": random_tokens(75, seed=1)}
    expected = hf_logits(arch, tokens["a"])
    assert expected.std() > 100 * ATOL  # the comparison is not vacuous
    model = our_model(arch, backend)
    caches = make_kv_caches(arch, model)
    rows = [("a", shuffled_blocks(2)[:3], 0, 75)]
    check_rows(arch, run_step(arch, model, caches, rows, tokens), rows, tokens)
    assert null_page_untouched(arch, caches, backend_of(model).block_dim)


# Per sequence, the tokens of each step: chunks across block boundaries (32), decodes
# (a 1-token chunk is a decode row), a sequence whose prompt is one token ("d").
SCHEDULES = {
    "a": (20, 25, 30, 1, 1, 1, 1),
    "b": (33, 1, 1, 1, 7, 1),
    "c": (31, 1, 32, 1, 1),
    "d": (1, 1, 1, 40, 1),
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_and_decode_batches_match_hf(arch: str, backend: str) -> None:
    tokens = {
        name: random_tokens(sum(s), seed=10 + i) for i, (name, s) in enumerate(SCHEDULES.items())
    }
    blocks = iter(shuffled_blocks(3))
    tables = {
        name: [next(blocks) for _ in range(math.ceil(sum(s) / block_size(arch)))]
        for name, s in SCHEDULES.items()
    }
    model = our_model(arch, backend)
    caches = make_kv_caches(arch, model)
    done = dict.fromkeys(SCHEDULES, 0)
    for step in range(max(len(s) for s in SCHEDULES.values())):
        rows = [
            (name, tables[name], done[name], s[step])
            for name, s in SCHEDULES.items()
            if step < len(s)
        ]
        rows.sort(key=lambda r: r[3] != 1)  # decode rows first
        logits = run_step(arch, model, caches, rows, tokens, free_early_blocks=True)
        check_rows(arch, logits, rows, tokens)
        for name, _, _, n in rows:
            done[name] += n
    assert null_page_untouched(arch, caches, backend_of(model).block_dim)


def test_a_prefix_cache_hit_restarts_from_a_full_blocks_state(arch: str) -> None:
    bs = block_size(arch)
    prompt = random_tokens(70, seed=20)
    tokens = {"a": prompt + (7,), "b": prompt[: 2 * bs] + random_tokens(21, seed=21)}
    blocks = shuffled_blocks(4)
    table_a, table_b = blocks[:3], blocks[:2] + blocks[3:4]  # b shares a's 2 full blocks
    model = our_model(arch)
    caches = make_kv_caches(arch, model)
    rows = [("a", table_a, 0, 70)]
    check_rows(arch, run_step(arch, model, caches, rows, tokens), rows, tokens)
    rows = [("b", table_b, 2 * bs, 20)]  # computed before: the 64 cached tokens
    check_rows(arch, run_step(arch, model, caches, rows, tokens), rows, tokens)
    rows = [("a", table_a, 70, 1), ("b", table_b, 2 * bs + 20, 1)]  # each its own last page
    check_rows(arch, run_step(arch, model, caches, rows, tokens), rows, tokens)


def test_a_copied_page_carries_the_state(arch: str) -> None:
    """Copy-on-write: a sequence forked after 40 tokens continues from a copy of the
    partly filled page, both branches match HF with their own next tokens."""
    prompt = random_tokens(40, seed=30)
    tokens = {"a": prompt + random_tokens(3, seed=31), "b": prompt + random_tokens(3, seed=32)}
    blocks = shuffled_blocks(5)
    table_a, table_b = blocks[:2], [blocks[0], blocks[2]]
    model = our_model(arch)
    caches = make_kv_caches(arch, model)
    rows = [("a", table_a, 0, 40)]
    check_rows(arch, run_step(arch, model, caches, rows, tokens), rows, tokens)
    model.model.layers[3].self_attn.attn.backend.copy_blocks(
        caches, torch.tensor([blocks[1]]), torch.tensor([blocks[2]])
    )
    for start in (40, 41, 42):
        rows = [("a", table_a, start, 1), ("b", table_b, start, 1)]
        check_rows(arch, run_step(arch, model, caches, rows, tokens), rows, tokens)


def test_each_of_two_ranks_holds_its_key_heads_with_their_value_heads(arch: str) -> None:
    """Under tensor parallelism a rank's DeltaNet keeps, of the one-device layer, its key
    heads' q and k channels and their value heads' v channels (projection rows and
    convolution), their z/b/a rows, dt_bias and A_log, out_proj's matching input
    columns, and half of each state (tests/engine/test_tensor_parallel.py runs it)."""
    one = our_model(arch).model.layers[0].self_attn
    weights = hf_model(arch).state_dict()
    kd, vd, hd = one.key_dim // 2, one.value_dim // 2, one.num_v_heads // 2
    for rank in (0, 1):
        model = model_class(arch)(config(arch), ReferenceBackend(), TensorParallelGroup(rank, 2))
        model.load_weights(weights.items())
        mine = model.model.layers[0].self_attn
        k, v = slice(rank * kd, (rank + 1) * kd), slice(rank * vd, (rank + 1) * vd)
        heads = slice(rank * hd, (rank + 1) * hd)
        for ours, full in ((mine.in_proj_qkv, one.in_proj_qkv), (mine.conv1d, one.conv1d)):
            q_all, k_all, v_all = full.weight.split([one.key_dim, one.key_dim, one.value_dim])
            torch.testing.assert_close(ours.weight, torch.cat([q_all[k], k_all[k], v_all[v]]))
        torch.testing.assert_close(mine.in_proj_z.weight, one.in_proj_z.weight[v])
        for name in ("in_proj_b", "in_proj_a"):
            torch.testing.assert_close(getattr(mine, name).weight, getattr(one, name).weight[heads])
        torch.testing.assert_close(mine.dt_bias, one.dt_bias[heads])
        torch.testing.assert_close(mine.A_log, one.A_log[heads])
        torch.testing.assert_close(mine.out_proj.weight, one.out_proj.weight[:, v])
        assert mine.recurrent_shape == (hd, *one.recurrent_shape[1:])
        assert mine.conv_shape == (one.conv_shape[0] // 2, one.conv_shape[1])
        assert (mine.recurrent_shape, mine.conv_shape) == state_shapes(config(arch), 2)


def test_multimodal_checkpoints_are_refused_by_name() -> None:
    assert resolve_model_class("Qwen3_5ForCausalLM") is Qwen3_5ForCausalLM
    with pytest.raises(ValueError, match="Qwen3_5ForConditionalGeneration.*text-only"):
        resolve_model_class("Qwen3_5ForConditionalGeneration")


def test_checkpoint_names_load_into_the_layers(arch: str) -> None:
    """`linear_attn` is the DeltaNet; q_proj's rows alternate query and gate per head."""
    model, state = our_model(arch), hf_model(arch).state_dict()
    layer = model.model.layers[0].self_attn
    assert isinstance(layer, GatedDeltaNet)
    torch.testing.assert_close(layer.A_log, state["model.layers.0.linear_attn.A_log"])
    qkv = model.model.layers[3].self_attn.qkv_proj.weight
    q_rows = state["model.layers.3.self_attn.q_proj.weight"].shape[0]
    torch.testing.assert_close(qkv[:q_rows], state["model.layers.3.self_attn.q_proj.weight"])
