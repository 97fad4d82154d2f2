"""Piecewise CUDA graphs (engine/worker/piecewise_graphs.py): the forward split at the
attention calls and padded to capture sizes. On the CPU the pieces are plain calls, so
the split, the padding and the attention wrapper are checked here token for token
against the eager forward; on a GPU the same pieces are captured and replayed."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker.attention import ReferenceBackend
from engine.worker.attention.metadata import AttentionMetadata
from engine.worker.attention.spec import AttentionSpec
from engine.worker.compiled_model import OpaqueBackend
from engine.worker.models.fused_moe import FusedMoE
from engine.worker.piecewise_graphs import (
    DEFAULT_CAPTURE_SIZES,
    CallOrder,
    GraphMode,
    GraphPiece,
    PiecewiseGraphs,
    capture_sizes,
    static_storage,
)
from tests.engine.tiny_models import ARCHITECTURES, save_hf_model

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[5, 9, 13], [1, 2, 3, 4, 5, 6, 7], [42] * 11, [8, 1]]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
ENGINE = dict(skip_tokenizer_init=True, block_size=4, max_model_len=64, kv_cache_memory=1 << 24)


def test_capture_sizes_default_to_the_budget_and_are_checked():
    assert capture_sizes(None, 20) == (1, 2, 4, 8, 16)
    assert capture_sizes(None, 10_000) == DEFAULT_CAPTURE_SIZES
    assert capture_sizes([16, 4, 4, 1], 64) == (1, 4, 16)
    for bad in ([], [0], [3, -1], [2.5]):
        with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
            capture_sizes(bad, 64)
    with pytest.raises(ValueError, match="cudagraph_capture_sizes must be a non-empty list"):
        LLM("builtin:tiny", cudagraph_capture_sizes=[0])


def test_padded_rows_attend_as_nothing_and_come_back_zero():
    """The wrapper attends the step's real tokens and pads the output with zeros."""
    torch.manual_seed(0)
    kc, vc = torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 8)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 3]),
        seq_lens=torch.tensor([5, 2]),
        block_tables=torch.tensor([[0, 1], [2, 0]]),
        slot_mapping=torch.tensor([4, 8, 9]),
        query_lens_cpu=(1, 2),
        seq_lens_cpu=(5, 2),
        num_decodes=1,
    )
    q, k, v = torch.randn(8, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    spec = AttentionSpec(scale=0.3)
    want = ReferenceBackend().forward(q[:3], k[:3], v[:3], (kc.clone(), vc.clone()), metadata, spec)
    got = OpaqueBackend(ReferenceBackend()).forward(q, k, v, (kc, vc), metadata, spec)
    assert got.shape == (8, 4, 8)
    assert torch.equal(got[:3], want) and not got[3:].any()


def run(directory, **settings):
    llm = LLM(str(directory), **ENGINE, **settings)
    out = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.engine.check_integrity()
    return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out]


@pytest.mark.parametrize("name", ["llama", "gemma2", "qwen3-moe"])
def test_the_split_forward_answers_as_the_eager_one(name, tmp_path):
    save_hf_model(name, tmp_path)
    _, want = run(tmp_path)
    llm, got = run(tmp_path, cudagraph_capture_sizes=[2, 4, 8, 16])
    graphs = llm.engine.worker.runner.graphs
    assert got == want
    layers = llm.config.model.num_layers
    assert len(graphs.pieces) >= layers + 1  # split at every attention call at least
    assert all(piece.num_calls for piece in graphs.pieces)
    assert graphs.padded_size(3) == 4 and graphs.padded_size(17) is None  # 17: eager


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_graph_semantics_emulated_answer_as_eager(name, tmp_path):
    """A CUDA graph's contract emulated on the CPU (inputs and outputs fixed at
    capture; a replay reads what capture kept, writes what capture made) over torch's
    layer ops, the pieces CUDA gets: one piece serves every layer, so each layer must
    keep its own graph and its weights (a signature by shapes alone replayed layer 0's
    graph for layer 1 by copying layer 1's weights over layer 0's: garbage on a GPU)."""
    save_hf_model(name, tmp_path)
    torch_ops = dict(attention_backend="sdpa", linear_kernel="torch")
    _, want = run(tmp_path, **torch_ops)
    sizes = (2, 4, 8, 16)
    llm = LLM(str(tmp_path), **ENGINE, **torch_ops, cudagraph_capture_sizes=list(sizes))
    runner = llm.engine.worker.runner
    runner.graphs = PiecewiseGraphs(runner.model, sizes, "cpu", GraphMode.EMULATED)
    weights = [w.clone() for w in runner.model.parameters()]
    out = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.engine.check_integrity()
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out] == want
    assert all(torch.equal(a, b) for a, b in zip(weights, runner.model.parameters(), strict=True))
    pieces = runner.graphs.pieces
    assert sum(piece.num_replays for piece in pieces) > 0
    forwards = pieces[0].num_calls  # the first piece opens every forward
    shared = [p for p in pieces if p.num_calls > forwards and p._graphs]  # serve layers
    assert all(len(p._graphs) >= 2 for p in shared)  # a graph per layer
    moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert all(m.forward._torchdynamo_disable for m in moe)  # eager between the pieces


def test_signatures_hold_the_model_s_own_storage_and_activations_by_shape():
    model = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    piece = GraphPiece(lambda *a: a, GraphMode.EMULATED, None, static_storage(model), CallOrder())
    first, second = model[0].weight, model[1].weight
    assert piece._signature(first) != piece._signature(second)
    assert piece._signature(first[:2]) != piece._signature(second[:2])  # views: theirs
    assert piece._signature(torch.randn(3, 4)) == piece._signature(torch.randn(3, 4))
    assert piece._signature(7) == 7


def test_eager_and_compiled_models_take_no_graphs(tmp_path):
    save_hf_model("llama", tmp_path)
    assert LLM(str(tmp_path), **ENGINE).engine.worker.runner.graphs is None  # CPU default
    eager = LLM(str(tmp_path), **ENGINE, enforce_eager=True, cudagraph_capture_sizes=[4])
    assert eager.engine.worker.runner.graphs is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_cuda_graphs_are_captured_replayed_and_answer_as_plain_pieces(name, tmp_path):
    """Against the same split forward run as plain calls, so the padding (23 prompt
    tokens run as 32) is the same on both sides: a padded GEMM may pick another
    cuBLAS kernel than the eager forward's and round differently (the padding itself
    is checked token for token on the CPU above)."""
    save_hf_model(name, tmp_path)
    sizes = [4, 8, 16, 32]
    plain = LLM(str(tmp_path), **ENGINE, cudagraph_capture_sizes=sizes)
    runner = plain.engine.worker.runner
    runner.graphs = PiecewiseGraphs(runner.model, sizes, "cuda", GraphMode.PLAIN)
    out = plain.generate(PROMPTS, PARAMS, use_tqdm=False)
    want = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out]
    del plain, runner
    llm, got = run(tmp_path, cudagraph_capture_sizes=sizes)
    assert got == want
    assert sum(piece.num_replays for piece in llm.engine.worker.runner.graphs.pieces) > 0
