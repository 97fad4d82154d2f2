"""`LookaheadPolicy`: which decoding rows get draft slots, and the batch rule that turns
speculation down."""

from __future__ import annotations

import pytest

from engine.core.lookahead_policy import LookaheadPolicy
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.structured_outputs import StructuredOutputsParams

pytestmark = pytest.mark.timeout(30)


def decoding(params: SamplingParams | None = None, request_id: str = "r") -> Request:
    r = Request(request_id, [1, 2, 3], params or SamplingParams(temperature=0), 0)
    r.output_token_ids = [4]
    r.num_computed_tokens = 3
    return r


def test_free_decoding_rows_get_k_slots_and_others_none():
    policy = LookaheadPolicy(3)
    assert policy.lookahead(decoding(), 1) == 3
    assert policy.lookahead(decoding(SamplingParams(temperature=0.7)), 1) == 3  # unseeded
    assert policy.lookahead(decoding(SamplingParams(temperature=0, seed=1)), 1) == 3  # greedy
    seeded = SamplingParams(temperature=0.7, seed=1)
    assert policy.lookahead(decoding(seeded), 1) == 0  # keeps its seeded noise
    constrained = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    assert policy.lookahead(decoding(constrained), 1) == 0
    prefilling = decoding()
    prefilling.num_computed_tokens = 1
    assert policy.lookahead(prefilling, 1) == 0


def test_no_row_speculates_past_the_batch_size():
    policy = LookaheadPolicy(2, max_batch=4)
    assert policy.lookahead(decoding(), 4) == 2
    assert policy.lookahead(decoding(), 5) == 0


def test_k_is_at_least_one():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LookaheadPolicy(0)
