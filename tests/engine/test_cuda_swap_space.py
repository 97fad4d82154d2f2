"""On a CUDA device the swap space is pinned host memory: the kernels' block copies need it
(an unpinned swap space made every swap fail on CUDA). Skips without a GPU."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_the_swap_space_of_a_cuda_device_is_pinned_and_swaps_work():
    llm = LLM(
        "builtin:tiny",
        device="cuda",
        block_size=16,
        max_model_len=64,
        max_num_batched_tokens=16,
        kv_cache_memory=1 << 16,
        swap_space=0.01,
        preemption_mode="swap",
    )
    with llm:
        runner = llm.engine.worker.runner
        assert runner.swap_cache
        assert all(t.is_pinned() for pair in runner.swap_cache for t in pair)
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        outs = llm.generate([[1, 2, 3 + i] for i in range(8)], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 30 for o in outs)
        assert llm.stats().num_swaps > 0
        llm.engine.check_integrity()
