import math

import pytest
import torch

from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.worker.logprobs import Logprob, compute_token_logprobs, to_dicts
from engine.worker.sampler import Sampler
from engine.worker.sampling_metadata import SamplingMetadata, SamplingRow, step_seed

V = 32


def make_md(params, outputs=None, prompts=None, stop_ids=None, vocab=V):
    n = len(params)
    outputs = outputs or [[] for _ in range(n)]
    prompts = prompts or [[] for _ in range(n)]
    stop_ids = stop_ids or [frozenset() for _ in range(n)]
    rows = [SamplingRow(*r) for r in zip(params, prompts, outputs, stop_ids, strict=True)]
    return SamplingMetadata.from_rows(rows, vocab, "cpu")


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax():
    logits = torch.randn(8, V, generator=gen())
    md = make_md([SamplingParams(temperature=0.0)] * 8)
    assert md.all_greedy and not md.all_random
    out = Sampler(gen(1))(logits, md)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_input_logits_untouched_and_low_precision_ok():
    logits = torch.randn(4, V, generator=gen()).to(torch.bfloat16)
    before = logits.clone()
    md = make_md([SamplingParams(temperature=0.0, logit_bias={1: 5.0})] * 4)
    Sampler()(logits, md)
    assert torch.equal(logits, before)


def test_temperature_to_zero_limit_is_greedy():
    logits = torch.randn(64, V, generator=gen(2)) * 3
    md = make_md([SamplingParams(temperature=1e-4)] * 64)
    assert md.all_random
    out = Sampler(gen(3))(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


@pytest.mark.parametrize("kwargs", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_narrow_filters_equal_greedy(kwargs):
    logits = torch.randn(64, V, generator=gen(4))
    md = make_md([SamplingParams(temperature=1.5, **kwargs)] * 64)
    out = Sampler(gen(5))(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(40, V, generator=gen(6))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(40)]
    md = make_md(params)
    assert not md.all_greedy and not md.all_random
    tokens = Sampler(gen(7))(logits, md).sampled_token_ids
    assert torch.equal(tokens[1::2], logits[1::2].argmax(-1))
    assert not torch.equal(tokens[0::2], logits[0::2].argmax(-1))


def test_top_k_and_min_p_keep_only_allowed_tokens():
    logits = torch.randn(1, V, generator=gen(8)).repeat(2000, 1)
    top3 = set(logits[0].topk(3).indices.tolist())
    md = make_md([SamplingParams(top_k=3, temperature=2.0)] * 2000)
    assert md.any_top_k and not md.any_top_p
    tokens = set(Sampler(gen(9))(logits, md).sampled_token_ids.tolist())
    assert tokens == top3

    probs = torch.softmax(logits[0], -1)
    allowed = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    md = make_md([SamplingParams(min_p=0.3)] * 2000)
    tokens = set(Sampler(gen(10))(logits, md).sampled_token_ids.tolist())
    assert tokens <= allowed and len(tokens) > 1


def test_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    md = make_md([SamplingParams(top_p=0.75)] * 4000, vocab=4)
    tokens = Sampler(gen(11))(logits, md).sampled_token_ids
    assert set(tokens.tolist()) == {0, 1}
    md = make_md([SamplingParams(top_p=0.85)] * 4000, vocab=4)
    tokens = Sampler(gen(11))(logits, md).sampled_token_ids
    assert set(tokens.tolist()) == {0, 1, 2}


def test_logit_bias_forces_and_forbids_tokens():
    logits = torch.randn(16, V, generator=gen(12))
    params = [SamplingParams(logit_bias={"7": 100.0}), SamplingParams(temperature=0.0)] * 8
    tokens = Sampler(gen(13))(logits, make_md(params)).sampled_token_ids
    assert tokens[0::2].tolist() == [7] * 8
    assert torch.equal(tokens[1::2], logits[1::2].argmax(-1))

    flat = torch.zeros(2000, 3)
    md = make_md([SamplingParams(logit_bias={0: -100, 2: -100})] * 2000, vocab=3)
    assert set(Sampler(gen(14))(flat, md).sampled_token_ids.tolist()) == {1}


def test_logit_bias_out_of_vocab_is_rejected():
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        make_md([SamplingParams(logit_bias={V: 1.0})])


def reference_penalties(logits, params, prompt, output):
    """Plain per-token rewrite of one row: HF repetition, then OpenAI presence/frequency."""
    row = logits.tolist()
    for t in set(prompt) | set(output):
        pen = params.repetition_penalty
        row[t] = row[t] / pen if row[t] > 0 else row[t] * pen
    for t in set(output):
        count = output.count(t)
        row[t] -= params.frequency_penalty * count + params.presence_penalty
    return torch.tensor(row)


def test_penalties_match_plain_reference():
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, 3.0, -2.0, 0.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 0.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 0.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 0.0],
        ]
    )
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(repetition_penalty=1.3, presence_penalty=-1.0, frequency_penalty=1.5),
        SamplingParams(),
    ]
    prompts = [[0, 1], [0, 1, 5], [4, 4, 1], [0, 1, 2]]
    outputs = [[3, 3, 2], [3, 3, 3, 2], [0, 0, 5], [3, 3]]
    md = make_md(params, outputs, prompts, vocab=6)
    assert md.any_penalties
    got = Sampler.process_logits(logits, md)
    for i in range(4):
        want = reference_penalties(logits[i], params[i], prompts[i], outputs[i])
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)
    assert torch.equal(got[3], logits[3])  # no penalties: untouched


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    md = make_md([SamplingParams(temperature=0.0, repetition_penalty=2.0)], [[0]], vocab=3)
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [1]


def test_min_tokens_masks_stop_ids_until_reached():
    eos = 5
    logits = torch.full((1, V), -1.0)
    logits[0, eos] = 10.0
    logits[0, 9] = 9.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9])
    stops = frozenset({eos, 9})
    for n_out, want in [(0, 2), (2, 2), (3, eos), (4, eos)]:
        logits_i = logits.clone()
        logits_i[0, 2] = 1.0
        md = make_md([params], [[1] * n_out], stop_ids=[stops])
        assert Sampler()(logits_i, md).sampled_token_ids.tolist() == [want], n_out


def seeded_tokens(sampler, logits_seq, params, others, num_others):
    """Run steps; the seeded row sits at the end of `num_others` random rows each step."""
    tokens = []
    for step, logits in enumerate(logits_seq):
        rows = [SamplingRow(p, [1, 2], [0] * step) for p in others[:num_others]]
        rows.append(SamplingRow(params, [1, 2], [0] * step))
        batch = torch.cat([torch.randn(num_others, V, generator=gen(100 + step)), logits])
        md = SamplingMetadata.from_rows(rows, V, "cpu")
        tokens.append(sampler(batch, md).sampled_token_ids[-1].item())
    return tokens


def test_seeded_row_is_batch_and_generator_independent():
    logits_seq = [torch.randn(1, V, generator=gen(50 + s)) for s in range(12)]
    others = [SamplingParams(temperature=0.5 + i / 50, top_p=0.9) for i in range(50)]
    params = SamplingParams(seed=1234, top_k=20, top_p=0.95, temperature=1.3)
    alone = seeded_tokens(Sampler(gen(1)), logits_seq, params, others, 0)
    batched = seeded_tokens(Sampler(gen(2)), logits_seq, params, others, 50)
    default_rng = seeded_tokens(Sampler(), logits_seq, params, others, 50)
    assert alone == batched == default_rng
    other_seed = seeded_tokens(Sampler(gen(1)), logits_seq, params.with_updates(seed=7), others, 0)
    assert other_seed != alone


def test_step_seed_is_stateless_and_spreads():
    assert step_seed(42, 3) == step_seed(42, 3)
    seeds = {step_seed(42, i) for i in range(100)} | {step_seed(43, i) for i in range(100)}
    assert len(seeds) == 200
    assert step_seed(42, 0, 1) != step_seed(42, 0, 0)
    assert all(0 <= step_seed(s, 5) < 2**63 for s in (-(2**70), -1, 0, 2**90))


def test_unseeded_draws_match_softmax():
    draws = 20_000
    base = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0])
    logits = base.repeat(draws, 1)
    for params, expected in [
        (SamplingParams(), torch.softmax(base, -1)),
        (
            SamplingParams(temperature=0.5, top_k=3),
            torch.softmax(torch.where(base >= 0.2, base / 0.5, -math.inf), -1),
        ),
    ]:
        md = make_md([params] * draws, vocab=5)
        tokens = Sampler(gen(21))(logits, md).sampled_token_ids
        observed = torch.bincount(tokens, minlength=5).double()
        exp_counts = expected.double() * draws
        keep = exp_counts > 0
        assert observed[~keep].sum() == 0
        chi2 = ((observed[keep] - exp_counts[keep]) ** 2 / exp_counts[keep]).sum().item()
        assert chi2 < 30.0, (params, observed, exp_counts)


def test_logprobs_come_from_raw_logits():
    logits = torch.randn(6, V, generator=gen(30))
    params = [
        SamplingParams(logprobs=3, logit_bias={4: 50.0}),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(),
        SamplingParams(logprobs=5, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logprobs=1),
        SamplingParams(temperature=0.0),
    ]
    md = make_md(params, outputs=[[1, 2]] * 6)
    assert md.max_num_logprobs == 5 and md.logprobs_rows == [3, 0, None, 5, 1, None]
    out = Sampler(gen(31))(logits, md)
    assert out.sampled_token_ids[0].item() == 4
    lp = out.logprobs
    assert lp is not None and lp.topk_ids.shape == (6, 5)
    ref = torch.log_softmax(logits, -1)
    tokens = out.sampled_token_ids
    torch.testing.assert_close(lp.token_logprobs, ref.gather(1, tokens[:, None]).squeeze(1))
    want_ranks = [(ref[i] > ref[i, tokens[i]]).sum().item() + 1 for i in range(6)]
    assert lp.token_ranks.tolist() == want_ranks
    assert torch.equal(lp.topk_ids, ref.argsort(-1, descending=True)[:, :5])
    assert torch.all(lp.topk_logprobs[:, :-1] >= lp.topk_logprobs[:, 1:])
    dicts = to_dicts(lp, tokens, [n or 0 for n in md.logprobs_rows])
    assert len(dicts[0]) in (3, 4) and len(dicts[1]) == 1 and len(dicts[3]) in (5, 6)
    assert dicts[1][tokens[1].item()] == Logprob(pytest.approx(ref[1].max().item()), 1)


def test_compute_token_logprobs_shapes_and_to_dicts():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 3.0, 0.0, -1.0]], dtype=torch.float16)
    token_ids = torch.tensor([0, 1])
    tl = compute_token_logprobs(logits, token_ids, 0)
    assert tl.topk_ids.shape == (2, 0) and tl.topk_logprobs.shape == (2, 0)
    assert tl.token_logprobs.dtype == torch.float32 and tl.token_ranks.tolist() == [4, 1]
    tl = compute_token_logprobs(logits, token_ids, 50)  # K clipped to the vocab
    assert tl.num_top == 4 and tl.topk_ids[0].tolist() == [3, 2, 1, 0]
    rows = to_dicts(tl, token_ids, [2, 1])
    assert list(rows[0]) == [0, 3, 2]
    assert [lp.rank for lp in rows[0].values()] == [4, 1, 2]
    assert len(rows[1]) == 1 and rows[1][1].rank == 1  # tie with token 0: no duplicate
    assert rows[0][3].logprob == pytest.approx(torch.log_softmax(logits[0].float(), -1)[3].item())
    with pytest.raises(ValueError, match="one token id"):
        to_dicts(tl, token_ids, [1])


def test_metadata_flags_and_normalized_tensors():
    params = [
        SamplingParams(temperature=0.0, top_k=5),
        SamplingParams(top_k=0, top_p=1.0),
        SamplingParams(top_k=V + 10, seed=3),
    ]
    md = make_md(params)
    assert md.top_k.tolist() == [5, V, V]
    assert md.temperature.tolist() == [1.0, 1.0, 1.0]
    assert md.greedy.tolist() == [True, False, False]
    assert not (md.any_top_k or md.any_top_p or md.any_min_p or md.any_penalties)
    assert md.output_counts is None and md.logit_bias is None and md.min_tokens_mask is None
    assert md.seeded_rows == [(2, step_seed(3, 0))]
    assert md.max_num_logprobs == 0 and not md.any_logprobs


def test_empty_batch():
    md = make_md([])
    out = Sampler()(torch.empty(0, V), md)
    assert out.sampled_token_ids.shape == (0,)
