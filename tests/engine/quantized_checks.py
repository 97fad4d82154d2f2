"""How a quantized path is held to the float path it approximates (the quantized tests
share it), on tiny random models whose next-token distributions are nearly flat:

- teacher-forced: over each float-path sequence (prompt and greedy continuation), every
  token's log-probability on the quantized path is within `bound` of the float path's,
  within `mean_bound` on average, and the mean log-likelihood within `loglik_rel` (1%);
- greedy tokens are equal up to the first near-tie, a step whose two best candidates on
  the float path are within 2 x `bound` (the quantized path may rank those either way).
"""

from __future__ import annotations

from engine import LLM, SamplingParams


def first_near_tie(out, tie: float) -> int:
    """The first step whose two best candidates are within `tie` (len if none)."""
    for step, row in enumerate(out.logprobs):
        best, second = sorted((p.logprob for p in row.values()), reverse=True)[:2]
        if best - second < tie:
            return step
    return len(out.token_ids)


def mean_loglik(llm: LLM, text: str) -> float:
    """The mean log-probability of `text`'s tokens after the first (prompt logprobs)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    [out] = llm.generate([text], params, use_tqdm=False)
    rows, ids = out.prompt_logprobs[1:], out.prompt_token_ids[1:]
    return sum(row[i].logprob for row, i in zip(rows, ids, strict=True)) / len(ids)


def token_logprobs(llm: LLM, sequences: list[list[int]]) -> list[list[float]]:
    """Each sequence's token log-probabilities after its first token (prompt logprobs)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(sequences, params, use_tqdm=False)
    return [
        [
            row[t].logprob
            for row, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True)
        ]
        for o in outs
    ]


def assert_follows(
    quantized: LLM,
    floats: LLM,
    prompts: list,
    max_tokens: int,
    bound: float,
    mean_bound: float,
    loglik_rel: float = 0.01,
) -> None:
    """Checks `quantized` against `floats` as the module docstring says."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
    ours = quantized.generate(prompts, params, use_tqdm=False)
    theirs = floats.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ours, theirs, strict=True):
        clear = first_near_tie(b.outputs[0], 2 * bound)
        assert a.outputs[0].token_ids[:clear] == b.outputs[0].token_ids[:clear]
    sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in theirs]
    mine = [x for row in token_logprobs(quantized, sequences) for x in row]
    reference = [x for row in token_logprobs(floats, sequences) for x in row]
    shifts = [abs(x - y) for x, y in zip(mine, reference, strict=True)]
    assert max(shifts) <= bound, max(shifts)
    assert sum(shifts) / len(shifts) <= mean_bound, sum(shifts) / len(shifts)
    assert abs(sum(mine) / sum(reference) - 1) <= loglik_rel  # the mean log-likelihood
