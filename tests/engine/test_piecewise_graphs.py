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
from engine.worker.piecewise_graphs import DEFAULT_CAPTURE_SIZES, capture_sizes
from tests.engine.tiny_models import save_hf_model

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[5, 9, 13], [1, 2, 3, 4, 5, 6, 7], [42] * 11, [8, 1]]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
ENGINE = dict(skip_tokenizer_init=True, block_size=4, max_model_len=64)


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


def test_eager_and_compiled_models_take_no_graphs(tmp_path):
    save_hf_model("llama", tmp_path)
    assert LLM(str(tmp_path), **ENGINE).engine.worker.runner.graphs is None  # CPU default
    eager = LLM(str(tmp_path), **ENGINE, enforce_eager=True, cudagraph_capture_sizes=[4])
    assert eager.engine.worker.runner.graphs is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_are_captured_replayed_and_answer_as_eager(tmp_path):
    save_hf_model("llama", tmp_path)
    _, want = run(tmp_path, enforce_eager=True)
    llm, got = run(tmp_path, cudagraph_capture_sizes=[4, 8, 16, 32])
    assert got == want
    assert sum(piece.num_replays for piece in llm.engine.worker.runner.graphs.pieces) > 0
