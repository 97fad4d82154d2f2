"""Speculative decoding with prompt lookup (`speculative_config={"method": "ngram", ...}`).

- Greedy: the same tokens as without speculation on tiny models of seven architectures
  (a sliding window among them), in step and one step ahead, over the prefix cache,
  under preemption by recompute and by swap, with max_tokens, min_tokens and stop
  tokens, n=2, and with logprobs (the same ranks; values within float32 rounding of
  a verification step's batch against a decode step's). Drafts are both accepted and
  rejected in these runs (the stats say so), and the block tables check out after each.
- Sampled: at temperature 1 with top-k, three tokens sampled with drafts verified at
  every step follow the exact distribution (computed from transformers' own logits):
  chi-square over 30,000 samples, whose power against a 2-point shift of one token's
  probability is checked too. Seeded random requests do not speculate (their seeded
  noise stays plain sampling's): the same tokens with and without.
- The served wiring (a block ledger, a block manager, plans one step ahead) gives the
  offline tokens; what cannot speculate is refused by name.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.engine_args import EngineArgs
from engine.worker.sampler import Sampler
from engine.worker.sampling_metadata import SamplingMetadata, SamplingRow
from tests.engine.pipelined import add_all, run_pipelined, served_parts, swap_engine_kwargs
from tests.engine.tiny_models import VOCAB, build_hf_model, save_hf_model

pytestmark = pytest.mark.timeout(300)

FAMILIES = ["llama", "gpt2", "opt", "qwen3", "gemma2", "gpt-oss", "mistral-window"]
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": 64,  # batches speculate too (the default is 1)
}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(seed: int = 0, count: int = 6) -> list[list[int]]:
    """Prompts that repeat themselves (lookup finds drafts) and some that do not."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        piece = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
        if i % 3 == 2:
            out.append([rng.randrange(VOCAB) for _ in range(rng.randint(3, 20))])
        else:
            out.append((piece * 8)[: rng.randint(6, 30)])
    return out


def generate(path: str, ps, params, speculative: bool | dict, **kwargs) -> tuple[list, LLM]:
    """`speculative`: True for NGRAM, a dict for that config, False for none."""
    settings = dict(skip_tokenizer_init=True, max_model_len=96, seed=0)
    if speculative:
        settings["speculative_config"] = NGRAM if speculative is True else speculative
    llm = LLM(path, **{**settings, **kwargs})
    outs = llm.generate(ps, params, use_tqdm=False)
    return outs, llm


def token_ids(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def checked(llm: LLM):
    llm.engine.core.check_integrity()
    stats = llm.stats()
    llm.close()
    assert stats.num_used_blocks == 0 or stats.num_cached_blocks >= stats.num_used_blocks
    return stats


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp(request.param)
    save_hf_model(request.param, directory)
    return str(directory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("llama")
    save_hf_model("llama", directory)
    return str(directory)


@pytest.mark.parametrize("depth", [1, 2])
def test_greedy_tokens_equal_plain_decoding(family, depth):
    ps = prompts()
    plain, llm = generate(family, ps, GREEDY, False, pipeline_depth=depth)
    checked(llm)
    spec, llm = generate(family, ps, GREEDY, True, pipeline_depth=depth)
    assert token_ids(spec) == token_ids(plain)
    stats = checked(llm)
    assert stats.spec_decode_num_draft_tokens > 0


def test_drafts_are_accepted_and_rejected_and_save_steps(llama):
    ps = prompts(1, 8)
    plain, llm = generate(llama, ps, GREEDY, False)
    base = checked(llm)
    spec, llm = generate(llama, ps, GREEDY, True)
    stats = checked(llm)
    assert token_ids(spec) == token_ids(plain)
    accepted, verified = stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_draft_tokens
    assert 0 < accepted < verified
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == accepted
    assert list(stats.spec_decode_num_accepted_tokens_per_pos) == sorted(
        stats.spec_decode_num_accepted_tokens_per_pos, reverse=True
    )  # a draft is accepted only after every draft before it
    assert stats.num_steps < base.num_steps
    assert 0 < stats.spec_decode_acceptance_rate < 1
    assert stats.spec_decode_mean_accepted_length > 1


@pytest.mark.parametrize("depth", [1, 2])
def test_prefix_cache_hits_keep_the_tokens(llama, depth):
    ps = prompts(2)
    plain, llm = generate(llama, ps, GREEDY, False)
    checked(llm)
    spec, llm = generate(llama, ps, GREEDY, True, pipeline_depth=depth)
    again = llm.generate(ps, GREEDY, use_tqdm=False)  # over the cached prefixes
    stats = checked(llm)
    assert token_ids(spec) == token_ids(plain) == token_ids(again)
    assert stats.prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_keeps_the_tokens(llama, mode, depth):
    ps = prompts(3, 8)
    plain, llm = generate(llama, ps, GREEDY, False)
    checked(llm)
    tight = swap_engine_kwargs(llama, 24, 64 if mode == "swap" else 0, max_model_len=96)
    spec, llm = generate(llama, ps, GREEDY, True, pipeline_depth=depth, **tight)
    stats = checked(llm)
    assert token_ids(spec) == token_ids(plain)
    assert stats.num_preemptions > 0
    assert (stats.num_swaps > 0) == (mode == "swap")
    assert stats.spec_decode_num_accepted_tokens > 0


@pytest.mark.parametrize("depth", [1, 2])
def test_length_limits_min_tokens_and_stop_tokens(llama, depth):
    ps = prompts(4, 6)
    free, llm = generate(llama, ps, GREEDY, False)
    checked(llm)
    params = []
    for i, out in enumerate(free):
        tokens = out.outputs[0].token_ids
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=1 + i))
        elif i % 3 == 1:  # stops at a token's second occurrence: min_tokens skips the first
            stop = tokens[3]
            params.append(
                SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop], min_tokens=5)
            )
        else:
            params.append(SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tokens[6]]))
    plain, llm = generate(llama, ps, params, False, pipeline_depth=depth)
    checked(llm)
    spec, llm = generate(llama, ps, params, True, pipeline_depth=depth)
    checked(llm)
    assert token_ids(spec) == token_ids(plain)
    for p, out in zip(params, spec, strict=True):
        c = out.outputs[0]
        assert len(c.token_ids) <= p.max_tokens
        if p.stop_token_ids and c.finish_reason == "stop":
            assert c.token_ids.index(c.stop_reason) == len(c.token_ids) - 1  # nothing after
            assert len(c.token_ids) >= p.min_tokens


def test_logprobs_rank_and_value_as_without(llama):
    ps = prompts(5, 4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    plain, llm = generate(llama, ps, params, False)
    checked(llm)
    spec, llm = generate(llama, ps, params, True)
    stats = checked(llm)
    assert stats.spec_decode_num_accepted_tokens > 0
    for a, b in zip(plain, spec, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert cb.token_ids == ca.token_ids
        assert len(cb.logprobs) == len(ca.logprobs) == 16
        for ra, rb in zip(ca.logprobs, cb.logprobs, strict=True):
            assert list(ra) == list(rb)  # the same tokens, in the same order
            for token in ra:
                assert rb[token].rank == ra[token].rank
                assert rb[token].logprob == pytest.approx(ra[token].logprob, abs=1e-4)
        assert cb.cumulative_logprob == pytest.approx(ca.cumulative_logprob, abs=1e-3)


def test_parallel_samples_and_seeded_requests_keep_their_outputs(llama):
    ps = prompts(6, 3)
    params = [
        SamplingParams(temperature=0, max_tokens=12, n=2, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=12, ignore_eos=True),
    ]
    plain, llm = generate(llama, ps, params, False)
    checked(llm)
    spec, llm = generate(llama, ps, params, True)
    checked(llm)
    assert token_ids(spec) == token_ids(plain)


@pytest.mark.parametrize("depth", [1, 2])
def test_served_wiring_gives_the_offline_tokens(family, depth):
    """The served engine's pieces (a block ledger, a block manager, a worker fed plans
    up to `depth` ahead) with drafts give the offline tokens without them."""
    ps = prompts(7, 6)
    offline, llm = generate(family, ps, GREEDY, False)
    checked(llm)
    args = EngineArgs(family, skip_tokenizer_init=True, max_model_len=96, seed=0)
    args = EngineArgs(**{**args.__dict__, "speculative_config": NGRAM})
    parts, worker = served_parts(args)
    add_all(parts.core, ps, [GREEDY] * len(ps))
    outputs, _ = run_pipelined(parts, worker, depth)
    parts.core.check_integrity()
    assert [outputs[f"r{i}"] for i in range(len(ps))] == [o[0] for o in token_ids(offline)]
    assert parts.core.stats().spec_decode_num_draft_tokens > 0


def test_what_cannot_speculate_is_refused_by_name(llama, tmp_path):
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        LLM(llama, speculative_config={**NGRAM, "prompt_lookup_max": 0})
    save_hf_model("qwen3.5", tmp_path)
    with pytest.raises(ValueError, match="linear-attention"):
        LLM(str(tmp_path), skip_tokenizer_init=True, speculative_config=NGRAM)
    with LLM(
        llama,
        skip_tokenizer_init=True,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 2}',
    ) as llm:
        assert llm.config.speculative.prompt_lookup_min == 5  # vLLM's default bounds
        assert llm.config.speculative.disable_by_batch_size == 1  # the default


def test_by_default_only_a_lone_sequence_speculates(llama):
    config = {k: v for k, v in NGRAM.items() if k != "disable_by_batch_size"}
    ps = prompts(8, 4)
    _, llm = generate(llama, ps, GREEDY, False)
    checked(llm)
    with LLM(llama, skip_tokenizer_init=True, max_model_len=96, speculative_config=config) as llm:
        llm.generate(ps, GREEDY, use_tqdm=False)  # four at once: none speculates
        assert llm.stats().spec_decode_num_drafts == 0
        llm.generate(ps[:1], GREEDY, use_tqdm=False)  # alone: it does
        assert llm.stats().spec_decode_num_drafts > 0


# ----------------------------------------------------------------- the distribution

SMALL_VOCAB, SAMPLES = 6, 30_000
SAMPLED = SamplingParams(temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True)
FIRST = 3  # the tokens whose joint distribution is tested
REPEATING = [1, 2, 3, 1, 2, 3, 1, 2]


def exact_distribution(model, prompt: list[int], params: SamplingParams) -> dict:
    """P(t1, t2, t3) by transformers' logits, each step processed as the sampler does."""
    params = params.with_updates(max_tokens=FIRST)
    md = SamplingMetadata.from_rows([SamplingRow(params, prompt, [])], SMALL_VOCAB, "cpu")
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(params.max_tokens):
        grown = {}
        for prefix, p in probs.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1:]  # [1, V]
            step = Sampler.probabilities(Sampler.process_logits(logits, md), md)[0]
            for t in range(SMALL_VOCAB):
                grown[prefix + (t,)] = p * float(step[t])
        probs = grown
    return probs


def chi_square(counts: dict, expected: dict, n: int) -> tuple[float, int]:
    """The statistic and its degrees of freedom, cells under 5 expected pooled."""
    stat, pooled_o, pooled_e, cells = 0.0, 0, 0.0, 0
    for cell, p in expected.items():
        e = p * n
        if e < 5:
            pooled_o, pooled_e = pooled_o + counts.get(cell, 0), pooled_e + e
            continue
        stat += (counts.get(cell, 0) - e) ** 2 / e
        cells += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        cells += 1
    return stat, cells - 1


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_sampled_tokens_follow_the_exact_distribution(tmp_path, proposer):
    model = build_hf_model("llama", seed=3, vocab_size=SMALL_VOCAB)
    for param in model.parameters():  # flatter than the tiny models' sharp weights
        param.data.mul_(0.5)
    model.save_pretrained(tmp_path / "target")
    expected = exact_distribution(model, REPEATING, SAMPLED)
    if proposer == "ngram":
        config = {**NGRAM, "prompt_lookup_min": 1, "disable_by_batch_size": 1024}
    else:  # the target's greedy choice: accepted with its probability under sampling
        config = draft_config(str(tmp_path / "target"), disable_by_batch_size=1024)
    with LLM(
        str(tmp_path / "target"),
        skip_tokenizer_init=True,
        seed=5,
        max_model_len=32,
        speculative_config=config,
    ) as llm:
        outs = llm.generate([REPEATING] * SAMPLES, SAMPLED, use_tqdm=False)
        stats = llm.stats()
    counts: dict = {}
    for o in outs:
        cell = tuple(o.outputs[0].token_ids[:FIRST])
        counts[cell] = counts.get(cell, 0) + 1
    # most requests verified drafts after their first token (whose last token recurs in
    # the prompt); many accepted, many rejected, at both positions
    assert stats.spec_decode_num_drafts >= SAMPLES // 2
    assert min(stats.spec_decode_num_accepted_tokens_per_pos) > SAMPLES // 100
    assert 0.1 < stats.spec_decode_acceptance_rate < 0.9
    # The joint of the first three tokens, and the marginals of the second and third
    # (the tokens verification emits: a bias there shows most plainly in them).
    for position in (None, 1, 2):
        exp, got = marginal(expected, position), marginal(counts, position)
        stat, dof = chi_square(got, exp, SAMPLES)
        critical = chi2_critical(dof, 1e-3)
        assert stat < critical, f"{position}: chi-square {stat:.1f}, {dof} dof (< {critical:.1f})"
    # Power: moving 2 points of probability onto the second token's likeliest value
    # (from the others, in proportion) gives a noncentrality N * sum(delta^2 / p) that
    # puts the statistic's mean far past the critical value.
    second = marginal(expected, 1)
    top = max(second, key=second.get)  # a 1-tuple
    shifted = {
        c: p + 0.02 if c == top else p * (1 - (second[top] + 0.02)) / (1 - second[top])
        for c, p in second.items()
    }
    noncentrality = SAMPLES * sum((shifted[c] - p) ** 2 / p for c, p in second.items() if p > 0)
    dof = sum(1 for p in second.values() if p * SAMPLES >= 5) - 1
    assert dof + noncentrality > 2 * chi2_critical(dof, 1e-3)


def marginal(cells: dict, position: int | None) -> dict:
    """The distribution (or counts) of the token at `position`; None: the joint."""
    if position is None:
        return cells
    out: dict = {}
    for cell, value in cells.items():
        out[(cell[position],)] = out.get((cell[position],), 0) + value
    return out


def chi2_critical(dof: int, alpha: float) -> float:
    """The chi-square quantile by Wilson-Hilferty (within ~2% from 3 dof)."""
    z = {1e-3: 3.0902}[alpha]
    h = 2 / (9 * dof)
    return dof * (1 - h + z * h**0.5) ** 3


def test_exact_distribution_sums_to_one():
    model = build_hf_model("llama", seed=3, vocab_size=SMALL_VOCAB)
    expected = exact_distribution(model, REPEATING, SAMPLED)
    assert sum(expected.values()) == pytest.approx(1.0, abs=1e-5)
    assert len(expected) == SMALL_VOCAB**FIRST
    assert all(p >= 0 for p in expected.values())
    assert (
        sum(1 for c in itertools.product(range(SMALL_VOCAB), repeat=FIRST) if expected[c] > 0)
        <= 4**3
    )


# ----------------------------------------------------------------- a draft model

DRAFT_FAMILIES = ["llama", "gpt2", "opt", "qwen3"]  # one block table: no windows


def truncated_copy(name: str, directory) -> str:
    """The tiny `name` model cut to its first layer: a draft that agrees often, not always."""
    model = build_hf_model(name)
    config = model.config
    layers = "h" if name == "gpt2" else "layers"
    stack = (
        model.transformer
        if name == "gpt2"
        else model.model.decoder
        if name == "opt"
        else model.model
    )
    setattr(stack, layers, getattr(stack, layers)[:1])
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    for key in ("num_hidden_layers", "n_layer"):
        if hasattr(config, key):
            setattr(config, key, 1)
    model.save_pretrained(directory)
    return str(directory)


def draft_config(path: str, **extra) -> dict:
    config = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    return config | {"disable_by_batch_size": 64} | extra


@pytest.fixture(scope="module", params=DRAFT_FAMILIES)
def with_draft(request, tmp_path_factory) -> tuple[str, str]:
    target = tmp_path_factory.mktemp(request.param)
    save_hf_model(request.param, target)
    draft = truncated_copy(request.param, tmp_path_factory.mktemp(request.param + "-draft"))
    return str(target), draft


@pytest.mark.parametrize("depth", [1, 2])
def test_a_draft_models_greedy_tokens_equal_plain_decoding(with_draft, depth):
    target, draft = with_draft
    ps = prompts(9)
    plain, llm = generate(target, ps, GREEDY, False, pipeline_depth=depth)
    checked(llm)
    spec, llm = generate(target, ps, GREEDY, draft_config(draft), pipeline_depth=depth)
    again = llm.generate(ps, GREEDY, use_tqdm=False)  # over the cached prefixes
    stats = checked(llm)
    assert token_ids(spec) == token_ids(plain) == token_ids(again)
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_the_target_as_its_own_draft_is_always_accepted(llama):
    ps = prompts(10, 4)
    plain, llm = generate(llama, ps, GREEDY, False)
    base = checked(llm)
    spec, llm = generate(llama, ps, GREEDY, draft_config(llama))
    stats = checked(llm)
    assert token_ids(spec) == token_ids(plain)
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert stats.num_steps < base.num_steps / 2


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("depth", [1, 2])
def test_a_draft_model_under_preemption_forks_and_logprobs(llama, tmp_path, mode, depth):
    draft = truncated_copy("llama", tmp_path)
    ps = prompts(11, 8)
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2, logprobs=2)
        if i % 3 == 0
        else GREEDY
        for i in range(len(ps))
    ]
    plain, llm = generate(llama, ps, params, False)
    checked(llm)
    tight = swap_engine_kwargs(llama, 24, 64 if mode == "swap" else 0, max_model_len=96)
    tight["kv_cache_memory"] = tight["kv_cache_memory"] * 3 // 2  # + the 1-layer draft's
    spec, llm = generate(llama, ps, params, draft_config(draft), pipeline_depth=depth, **tight)
    stats = checked(llm)
    assert token_ids(spec) == token_ids(plain)
    assert stats.num_preemptions > 0 and (stats.num_swaps > 0) == (mode == "swap")
    assert stats.spec_decode_num_accepted_tokens > 0
    for a, b in zip(plain, spec, strict=True):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            if ca.logprobs is not None:
                assert [list(r) for r in cb.logprobs] == [list(r) for r in ca.logprobs]


def test_a_draft_model_that_cannot_serve_is_refused_by_name(llama, tmp_path):
    small = tmp_path / "small-vocab"
    build_hf_model("llama", vocab_size=SMALL_VOCAB).save_pretrained(small)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(llama, skip_tokenizer_init=True, speculative_config=draft_config(str(small)))
    windowed = tmp_path / "windowed"
    save_hf_model("mistral-window", windowed)
    with pytest.raises(ValueError, match="sliding-window"):
        LLM(str(windowed), skip_tokenizer_init=True, speculative_config=draft_config(llama))
