"""Every message the actors exchange: ONE schema module of frozen dataclasses.

Grouped by the inbox that receives them; each inbox decodes only its own group
(`INBOXES`). Field order is the wire format: append new fields at the end only
(`tests/engine/test_codec.py` pins every message's field order). Messages of six or
more fields are built by keyword (`kw_only`) or through a named constructor.

Sequence ids are part of the schema too: a request sampling several sequences (n,
best_of, a beam search) runs each as a sequence of its own, `sequence_id(request_id,
index)`, and the scheduler's and workers' messages carry those ids.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

from engine.kv_transfer.params import KVTransferParams
from engine.sampling_params import SamplingParams
from engine.structured_outputs import StructuredOutputsParams

# ---------------------------------------------------------------- shared parts


def sequence_id(request_id: str, index: int) -> str:
    """The id of sequence `index` of a multi-sequence request."""
    return f"{request_id}#{index}"


def request_id_of(seq_id: str) -> str:
    """The request a sequence id belongs to (`sequence_id`'s inverse; an id that names
    no sequence is returned as it is)."""
    return seq_id.partition("#")[0]


@dataclass(frozen=True)
class ChatToolCall:
    """A function call an assistant turn made: `arguments` is JSON text (OpenAI's
    `function.arguments`)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn; `role` is system, user, assistant or tool. An assistant turn may
    carry the `tool_calls` it made (its content may then be empty); a tool turn names
    the call it answers (`tool_call_id`) and may name the function (`name`)."""

    role: str
    content: str
    tool_calls: tuple[ChatToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    @classmethod
    def of(cls, message: dict) -> ChatMessage:
        """From an OpenAI-shaped message dict (checked already by its sender)."""
        calls = tuple(
            ChatToolCall(
                str(c.get("id")),
                str(c["function"].get("name")),
                str(c["function"].get("arguments")),
            )
            for c in message.get("tool_calls") or ()
        )
        return cls(
            str(message.get("role")),
            str(message.get("content") or ""),
            calls,
            message.get("tool_call_id"),
            message.get("name"),
        )

    def template_dict(self) -> dict:
        """What the chat template sees: role and content, and the tool fields set. Call
        arguments that are a JSON object reach it parsed (templates write them with
        `tojson`, as transformers' and vLLM's callers pass them)."""
        out: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": _json_object_or_text(c.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _json_object_or_text(text: str) -> object:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


@dataclass(frozen=True)
class ChatTemplateArgs:
    """What a chat template sees beside the messages: the request's `tools` (OpenAI's
    list, as JSON text) and its `chat_template_kwargs` (a JSON object's text: extra
    template variables, e.g. Qwen3's `enable_thinking`). JSON text because the wire
    carries typed fields, and these are any JSON the client sent (checked by it)."""

    tools_json: str | None = None
    kwargs_json: str | None = None

    def variables(self) -> dict:
        """The template variables these add (`tools` and each kwarg)."""
        out = json.loads(self.kwargs_json) if self.kwargs_json else {}
        if self.tools_json:
            out["tools"] = json.loads(self.tools_json)
        return out


@dataclass(frozen=True)
class ChatPrompt:
    """A chat as a prompt: its messages and what its template sees beside them. Where a
    prompt may be a chat, a list of message dicts is one with no template args."""

    messages: tuple[ChatMessage, ...]
    template_args: ChatTemplateArgs | None = None

    @classmethod
    def of(
        cls,
        messages: list[dict],
        *,
        tools: list | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> ChatPrompt:
        """From message dicts, the `tools` list and `chat_template_kwargs` (None: unset)."""
        args = None
        if tools or chat_template_kwargs:
            args = ChatTemplateArgs(
                json.dumps(tools, ensure_ascii=False) if tools else None,
                json.dumps(chat_template_kwargs, ensure_ascii=False)
                if chat_template_kwargs
                else None,
            )
        return cls(chat_of(messages), args)

    def template_inputs(self) -> tuple[list[dict], dict | None]:
        """What the chat template renders: the messages as template dicts, and the
        variables beside them (None: none). The one conversion offline and served use."""
        variables = None if self.template_args is None else self.template_args.variables()
        return [m.template_dict() for m in self.messages], variables


@dataclass(frozen=True)
class AbortRequest:
    """Stop `request_id` and free its blocks (client -> tokenizer -> scheduler)."""

    request_id: str


@dataclass(frozen=True)
class TokenLogprob:
    """One candidate token at one position: its log-probability, its 1-based rank in the
    vocabulary, and its text (None until the tokenizer actor fills it in)."""

    token_id: int
    logprob: float
    rank: int
    decoded_token: str | None


# The logprobs at one position: the chosen token first, then the top candidates asked for.
LogprobRow = tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class RequestFailed:
    """`request_id` failed inside the engine and is over: its blocks are freed, and its
    client gets `error` (scheduler -> tokenizer; worker -> scheduler inside a
    StepResult, with the id of the sequence it could not run)."""

    request_id: str
    error: str


class ErrorKind(StrEnum):
    """Why a request ended in an error: its input was refused (the client's to fix), the
    engine failed it, or it outlived the server's request timeout."""

    INVALID = "invalid_request"
    ENGINE = "engine_error"
    TIMEOUT = "timeout"
    BUSY = "busy"  # refused for load, not for its content: retry later


@dataclass(frozen=True)
class Shutdown:
    """Stop the receiving actor gracefully; `reason` is logged."""

    reason: str


# ---------------------------------------------------------------- tokenizer inbox


# What a client may pass as a prompt: text, token ids, or a chat (its message dicts, or a
# ChatPrompt with the template's tools and kwargs); and as a chat alone.
ChatInput = list[dict] | ChatPrompt
PromptInput = str | list[int] | ChatInput


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """A client's request. Exactly one of prompt, prompt_token_ids, messages is set;
    outputs go back to the client named `client_id`. `strict_max_tokens`: the client
    chose `params.max_tokens` itself, so a prompt plus max_tokens beyond the context is
    refused (vLLM's OpenAI server) instead of generating until the context is full."""

    request_id: str
    client_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...] | None
    messages: tuple[ChatMessage, ...] | None
    params: SamplingParams
    strict_max_tokens: bool = False
    template_args: ChatTemplateArgs | None = None  # a chat's tools and template kwargs

    @classmethod
    def of(
        cls,
        request_id: str,
        client_id: str,
        prompt: object,
        params: SamplingParams,
        *,
        strict_max_tokens: bool = False,
    ) -> GenerateRequest:
        """From what a caller passes as a prompt: text, token ids, or a chat (a
        ChatPrompt, or a list of OpenAI-shaped message dicts). ValueError for anything
        else."""
        text = ids = chat = args = None
        items = list(prompt) if isinstance(prompt, list | tuple) else None
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, ChatPrompt):
            chat, args = prompt.messages, prompt.template_args
        elif items and all(isinstance(m, dict) for m in items):
            chat = chat_of(items)
        elif items is not None and all(type(t) is int for t in items):
            ids = tuple(items)
        else:
            raise ValueError("prompt must be a string, a list of token ids (ints) or chat messages")
        return cls(
            request_id=request_id,
            client_id=client_id,
            prompt=text,
            prompt_token_ids=ids,
            messages=chat,
            params=params,
            strict_max_tokens=strict_max_tokens,
            template_args=args,
        )


def chat_of(messages: list[dict]) -> tuple[ChatMessage, ...]:
    """OpenAI-shaped message dicts -> ChatMessages."""
    return tuple(ChatMessage.of(m) for m in messages)


@dataclass(frozen=True, kw_only=True)
class TokenizeRequest:
    """Text or a chat -> token ids, exactly as a GenerateRequest's would be tokenized
    (client -> tokenizer; no request state is kept, nothing reaches the scheduler).
    Exactly one of prompt, messages is set; `add_special_tokens` applies to a prompt
    (BOS and the like), `add_generation_prompt` to a chat. Answered with a
    TokenizeResult under `request_id` to the client named `client_id`."""

    request_id: str
    client_id: str
    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    template_args: ChatTemplateArgs | None = None  # a chat's tools and template kwargs

    @classmethod
    def of_prompt(
        cls, request_id: str, client_id: str, prompt: str, *, add_special_tokens: bool = True
    ) -> TokenizeRequest:
        """Tokenize a text prompt (BOS and the like unless `add_special_tokens` is False)."""
        return cls(
            request_id=request_id,
            client_id=client_id,
            prompt=prompt,
            messages=None,
            add_special_tokens=add_special_tokens,
        )

    @classmethod
    def of_chat(
        cls,
        request_id: str,
        client_id: str,
        messages: tuple[ChatMessage, ...],
        *,
        add_generation_prompt: bool = True,
        template_args: ChatTemplateArgs | None = None,
    ) -> TokenizeRequest:
        """Tokenize a chat as the chat template renders it."""
        return cls(
            request_id=request_id,
            client_id=client_id,
            prompt=None,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            template_args=template_args,
        )


@dataclass(frozen=True)
class DetokenizeRequest:
    """Token ids -> text, special tokens kept unless `skip_special_tokens` (client ->
    tokenizer); answered with a TokenizeResult whose `text` is set."""

    request_id: str
    client_id: str
    token_ids: tuple[int, ...]
    skip_special_tokens: bool = False


@dataclass(frozen=True, kw_only=True)
class TokenDelta:
    """One request's part of a TokenDeltas (a view; never sent alone): its new token ids
    and a finish reason when it ended. `logprobs`: one row per token id, when the request
    asked for them. `prompt_logprobs`: rows for prompt positions 1.. (the first prompt
    token has none), on the request's first delta only."""

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: tuple[LogprobRow, ...] | None = None
    prompt_logprobs: tuple[LogprobRow, ...] | None = None
    kv_transfer_params: KVTransferParams | None = None  # RequestFinish's, on the last delta


@dataclass(frozen=True)
class RequestFinish:
    """Why a request ended: finish reason, and the stop token or string that ended it;
    a prefill instance's `kv_transfer_params`: where the prompt's KV waits for a decode
    instance."""

    request_id: str
    finish_reason: str
    stop_reason: int | str | None
    kv_transfer_params: KVTransferParams | None = None


@dataclass(frozen=True)
class RequestLogprobs:
    """Logprob rows of one request from one step: its sampled token's row, or the prompt
    positions scored in that step, in order."""

    request_id: str
    rows: tuple[LogprobRow, ...]


@dataclass(frozen=True, kw_only=True)
class RankedSequence:
    """One whole output the engine ranked itself (a beam search hypothesis), sent once,
    when the search is done: output `index` (0 = best) of request `request_id`, its
    tokens, why it ended, its summed logprob and its score (the sum over its length to
    the power length_penalty)."""

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    finish_reason: str
    cumulative_logprob: float
    score: float


@dataclass(frozen=True, kw_only=True)
class TokenDeltas:
    """One step's new tokens (scheduler -> tokenizer), detokenized there. Column-wise:
    request `request_ids[i]` got token `token_ids[i]`; `finished` names those that ended
    with it; logprob rows only for requests that asked. `deltas()` gives per-request
    views. `ranked`: the whole outputs of beam searches that ended in this step (their
    prompt logprobs, if asked for, are in `prompt_logprobs` under the request id)."""

    step_id: int
    request_ids: tuple[str, ...]
    token_ids: tuple[int, ...]
    finished: tuple[RequestFinish, ...]
    logprobs: tuple[RequestLogprobs, ...]
    prompt_logprobs: tuple[RequestLogprobs, ...]
    ranked: tuple[RankedSequence, ...] = ()

    def deltas(self) -> Iterator[TokenDelta]:
        """One delta per token, in order: a request that got several tokens this step
        (accepted drafts) gets several deltas, each with its own logprob row; its
        prompt logprobs go with the first, its finish with the last."""
        finished = {f.request_id: f for f in self.finished}
        logprobs = {lp.request_id: lp.rows for lp in self.logprobs}
        prompt = {lp.request_id: lp.rows for lp in self.prompt_logprobs}
        last = {request_id: i for i, request_id in enumerate(self.request_ids)}
        seen: dict[str, int] = {}
        for i, (request_id, token) in enumerate(zip(self.request_ids, self.token_ids, strict=True)):
            n = seen[request_id] = seen.get(request_id, -1) + 1
            f = finished.get(request_id) if last[request_id] == i else None
            rows = logprobs.get(request_id)
            yield TokenDelta(
                request_id=request_id,
                token_ids=(token,),
                finish_reason=None if f is None else f.finish_reason,
                stop_reason=None if f is None else f.stop_reason,
                logprobs=None if rows is None else rows[n : n + 1],
                prompt_logprobs=prompt.get(request_id) if n == 0 else None,
                kv_transfer_params=None if f is None else f.kv_transfer_params,
            )


# ---------------------------------------------------------------- scheduler inbox


@dataclass(frozen=True)
class AddRequest:
    """A tokenized request, ready to schedule (tokenizer -> scheduler)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    arrival_time: float


@dataclass(frozen=True)
class DraftCount:
    """One sequence's speculation in one step: `num_drafts` draft tokens verified,
    `num_accepted` of them accepted (a leading run)."""

    request_id: str
    num_drafts: int
    num_accepted: int


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What step `step_id` did on worker `worker_id`, column-wise: request
    `sampled_ids[i]` sampled `sampled_token_ids[i]`. A sequence that verified draft
    tokens appears once per token it produced, in adjacent columns and in order: the
    drafts accepted, then the token sampled after them. `logprobs` holds an entry per
    sampled request that asked for logprobs, one row per token it produced;
    `prompt_logprobs` the prompt rows scored; `error` is set if the step failed;
    `busy_seconds` is how long it executed. `failed`: the sequences the worker could not
    run (it has forgotten them; the scheduler ends their requests with the error).
    `drafts`: what each sequence that verified drafts proposed and accepted.
    `loaded_ids`: requests whose prompt's KV arrived since the last result (a load that
    failed is in `failed`)."""

    step_id: int
    worker_id: int
    sampled_ids: tuple[str, ...]
    sampled_token_ids: tuple[int, ...]
    logprobs: tuple[RequestLogprobs, ...]
    prompt_logprobs: tuple[RequestLogprobs, ...]
    error: str | None
    busy_seconds: float
    failed: tuple[RequestFailed, ...] = ()
    drafts: tuple[DraftCount, ...] = ()
    loaded_ids: tuple[str, ...] = ()  # loads (StepPlan.load_ids) whose KV arrived

    @classmethod
    def empty(cls, step_id: int, worker_id: int) -> StepResult:
        """A step that sampled nothing (a plan of finished ids and block moves only)."""
        return cls.sampled(step_id, worker_id, {}, (), ())

    @classmethod
    def sampled(
        cls,
        step_id: int,
        worker_id: int,
        tokens: dict[str, int],
        logprobs: tuple[RequestLogprobs, ...],
        prompt_logprobs: tuple[RequestLogprobs, ...],
        accepted: dict[str, list[int]] | None = None,
        drafts: tuple[DraftCount, ...] = (),
    ) -> StepResult:
        """A step that ran: each sampling request's token (after the drafts it
        `accepted`, if any), and the logprob rows asked for."""
        if accepted:
            ids, token_ids = [], []
            for request_id, token in tokens.items():
                run = accepted.get(request_id, ())
                ids += [request_id] * (len(run) + 1)
                token_ids += [*run, token]
            sampled_ids, sampled_token_ids = tuple(ids), tuple(token_ids)
        else:
            sampled_ids, sampled_token_ids = tuple(tokens), tuple(tokens.values())
        return cls(
            step_id=step_id,
            worker_id=worker_id,
            sampled_ids=sampled_ids,
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            error=None,
            busy_seconds=0.0,
            drafts=drafts,
        )


@dataclass(frozen=True, kw_only=True)
class WorkerReady:
    """Start-up values a worker found (after loading and memory profiling), and the
    attention backend it chose."""

    worker_id: int
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    num_cpu_blocks: int = 0  # blocks of CPU swap space
    attention_backend: str = ""  # the backend the worker runs ("native", "sdpa", ...)
    attention_backend_reason: str = ""  # why it was chosen
    weights_bytes: int = 0  # the model's weights on this worker (blocks of quantized ones)
    kv_cache_bytes: int = 0  # its device KV cache (the scheduler's blocks and reserved pages)
    kv_cache_dtype: str = ""  # what the cache stores ("float32", "bfloat16", ...)
    quantization: str = ""  # how the linear layers hold their weights ("none", "gguf")


# ---------------------------------------------------------------- heartbeat inbox


@dataclass(frozen=True)
class WorkerHeartbeat:
    """A worker is alive (worker -> engine client, every interval, from a thread of its
    own, so a long step does not silence it): when it was sent (`time.monotonic()`,
    one clock for every process on the host). `expert_load`: a mixture of experts'
    (token, expert) assignments so far, per expert, summed over its MoE layers (empty
    for a dense model)."""

    worker_id: int
    sent_at: float
    expert_load: tuple[int, ...] = ()


# ---------------------------------------------------------------- scheduler's block_replies inbox


@dataclass(frozen=True)
class BlockOpsApplied:
    """The block manager's account of one exchange, replayed on its own tables: every
    block id its ops put into a table, in op order; its free and cached block counts
    after; and the first op it could not apply, if any. The scheduler checks all of it
    against its replica."""

    exchange_id: int
    block_ids: tuple[int, ...]
    num_free_blocks: int
    num_cached_blocks: int
    error: str | None = None


# ---------------------------------------------------------------- block manager inbox


class BlockOpKind(StrEnum):
    """The closed set of block-table changes (engine/kv/block_ops.py says what each does)."""

    GROW = "grow"
    FREE = "free"
    FORK = "fork"
    COW = "cow"
    MATCH = "match"
    CACHE = "cache"
    RESET = "reset"
    SWAP_OUT = "swap_out"
    SWAP_IN = "swap_in"
    SLIDE = "slide"
    TRIM = "trim"


@dataclass(frozen=True)
class BlockOp:
    """One change to the block tables, as the scheduler's replica made it (the kinds
    and what `num`, `parent_id` and `hashes` mean for each are in engine/kv/block_ops.py)."""

    kind: BlockOpKind
    seq_id: str
    num: int = 0
    parent_id: str = ""
    hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class ApplyBlockOps:
    """One exchange's block traffic in ONE message: every op since the last, in order."""

    exchange_id: int
    ops: tuple[BlockOp, ...]


# ---------------------------------------------------------------- worker inbox


@dataclass(frozen=True, kw_only=True)
class NewRequestData:
    """A request the worker has not seen: everything it caches about it. Its known
    output tokens are empty except for a forked beam, which starts with its parent's.
    `block_ids` is its block table; with several KV cache groups (a hybrid layout) the
    groups' tables interleaved by block position (entry `i * G + g`: group g's block
    i; engine/kv/hybrid_kv_cache_manager.py)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    output_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class CachedRequestData:
    """What changed for a request the worker has cached: `new_block_ids` extend its
    block table (a resumed request's whole table), or, when `first_block_index` >= 0,
    replace the table from that block on (copy-on-write gave it private copies).
    `last_token_id`, when set, replaces the newest output token the worker sampled
    itself (beam search chose another continuation for that beam)."""

    request_id: str
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int
    resumed_from_preemption: bool
    last_token_id: int | None = None
    first_block_index: int = -1
    # draft slots of the request's steps in flight: the worker may count up to this many
    # more computed tokens than `num_computed_tokens` (drafts it accepted meanwhile)
    num_lookahead_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """Step `step_id`: new requests in full; diffs for cached requests whose blocks
    changed or that resume after preemption (every other cached request just goes on
    from where the worker's own count says); then, column-wise, request
    `scheduled_ids[i]` computes `num_scheduled_tokens[i]` tokens; finished ids; and the
    copy-on-write copies (block `copy_src[i]` -> `copy_dst[i]`) to make before the step.

    Speculative decoding: a decoding row with `num_lookahead_tokens[i]` = k > 0 may
    verify up to k draft tokens its worker proposes after its one scheduled token (its
    table has the slots). Planning ahead of results, the scheduler's computed counts
    trail the worker's by the drafts accepted in steps still in flight: the worker places
    every row by its own count."""

    step_id: int
    new_requests: tuple[NewRequestData, ...]
    cached_requests: tuple[CachedRequestData, ...]
    scheduled_ids: tuple[str, ...]
    num_scheduled_tokens: tuple[int, ...]
    finished_ids: tuple[str, ...]
    copy_src: tuple[int, ...] = ()
    copy_dst: tuple[int, ...] = ()
    swap_out_src: tuple[int, ...] = ()  # device block -> CPU swap block, before the step
    swap_out_dst: tuple[int, ...] = ()
    swap_in_src: tuple[int, ...] = ()  # CPU swap block -> device block, after the swap-outs
    swap_in_dst: tuple[int, ...] = ()
    # constraints requests on their way will need: the worker starts compiling them now
    grammars: tuple[StructuredOutputsParams, ...] = ()
    # column-wise with scheduled_ids: draft tokens each row may verify (empty: none may)
    num_lookahead_tokens: tuple[int, ...] = ()
    # new requests whose prompt's KV the worker fetches from a prefill instance, in the
    # background (they are not scheduled until a StepResult's loaded_ids names them)
    load_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class PrepareGrammar:
    """A constraint a request being admitted will need (tokenizer -> scheduler, which
    passes it to the workers with its next StepPlan): the sampling worker compiles it in
    the background while the tokenizer checks it, so the request's first step does not
    stall the batch on the compile."""

    params: StructuredOutputsParams


# ---------------------------------------------------------------- client inbox


@dataclass(frozen=True, kw_only=True)
class OutputDelta:
    """Incremental output of one request to its client; `error` set on failure.
    `logprobs` and `prompt_logprobs` as in TokenDelta, with `decoded_token` filled in.
    A request sampling n sequences streams each under its `index`; each ends with its
    own finish reason."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None
    logprobs: tuple[LogprobRow, ...] | None = None
    prompt_logprobs: tuple[LogprobRow, ...] | None = None
    index: int = 0  # which sequence of an n > 1 request; -1: the whole request (abort, error)
    error_kind: ErrorKind | None = None  # set with `error`
    kv_transfer_params: KVTransferParams | None = None  # a prefill instance's, when it ends

    @classmethod
    def failed(cls, request_id: str, error: str, kind: ErrorKind = ErrorKind.ENGINE) -> OutputDelta:
        """The request (every sequence of it) ended with `error`."""
        return cls._whole_request(request_id, "error", error, kind)

    @classmethod
    def ranked(
        cls,
        request_id: str,
        index: int,
        text: str,
        token_ids: tuple[int, ...],
        finish_reason: str,
        num_prompt_tokens: int,
        prompt_logprobs: tuple[LogprobRow, ...] | None,
    ) -> OutputDelta:
        """Output `index` whole, sent once: one the engine ranked (a beam hypothesis)."""
        return cls(
            request_id=request_id,
            text=text,
            token_ids=token_ids,
            finish_reason=finish_reason,
            stop_reason=None,
            num_prompt_tokens=num_prompt_tokens,
            num_output_tokens=len(token_ids),
            error=None,
            prompt_logprobs=prompt_logprobs,
            index=index,
        )

    @classmethod
    def aborted(cls, request_id: str) -> OutputDelta:
        """The request (every sequence of it) was aborted."""
        return cls._whole_request(request_id, "abort", None, None)

    @classmethod
    def _whole_request(
        cls, request_id: str, finish_reason: str, error: str | None, kind: ErrorKind | None
    ) -> OutputDelta:
        return cls(
            request_id=request_id,
            text="",
            token_ids=(),
            finish_reason=finish_reason,
            stop_reason=None,
            num_prompt_tokens=0,
            num_output_tokens=0,
            error=error,
            index=-1,
            error_kind=kind,
        )


@dataclass(frozen=True, kw_only=True)
class TokenizeResult:
    """The answer to a TokenizeRequest or a DetokenizeRequest: the token ids, each one's
    text as it reads after other text (`token_strs`, so plain text's join back into
    it), and the whole text (a TokenizeRequest's: ""). `error`, when the input was
    refused, says why and names the field (the other fields are then empty);
    `error_kind` says whose fault (INVALID: the input's; BUSY: too much tokenizing
    queued, retry; ENGINE: a bug)."""

    request_id: str
    token_ids: tuple[int, ...]
    token_strs: tuple[str, ...]
    text: str
    error: str | None = None
    error_kind: ErrorKind | None = None

    @classmethod
    def refused(cls, request_id: str, error: str, kind: ErrorKind) -> TokenizeResult:
        """The input was refused: nothing but the error and whose fault it is."""
        return cls(
            request_id=request_id,
            token_ids=(),
            token_strs=(),
            text="",
            error=error,
            error_kind=kind,
        )


INBOXES: dict[str, tuple[type, ...]] = {
    "tokenizer": (
        GenerateRequest,
        AbortRequest,
        TokenDeltas,
        RequestFailed,
        Shutdown,
        TokenizeRequest,
        DetokenizeRequest,
    ),
    "scheduler": (AddRequest, AbortRequest, StepResult, WorkerReady, Shutdown, PrepareGrammar),
    "block_replies": (BlockOpsApplied,),
    "block_manager": (ApplyBlockOps, Shutdown),
    "worker": (StepPlan, Shutdown),
    "heartbeat": (WorkerHeartbeat,),
    "client": (OutputDelta, TokenizeResult),
}
