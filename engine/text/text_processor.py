"""The tokenizer actor's engine object: text in (prompts, chats), text deltas out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from engine.messages import (
    AbortRequest,
    AddRequest,
    ChatMessage,
    ChatPrompt,
    ChatTemplateArgs,
    DetokenizeRequest,
    ErrorKind,
    GenerateRequest,
    LogprobRow,
    OutputDelta,
    RankedSequence,
    RequestLogprobs,
    TokenDelta,
    TokenizeRequest,
    TokenizeResult,
    sequence_id,
)
from engine.structured_outputs import StructuredOutputsParams
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.request_validation import RequestLimits, validate_request
from engine.text.stop_strings import find_stop, hold_back
from engine.text.text_checks import check_text
from engine.text.token_text import TokenTexts
from engine.text.tokenizer import Tokenizer


class NoText:
    """The detokenizer of an engine without a tokenizer: no text, ever."""

    def append(self, token_ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


@dataclass
class _TextState:
    """What the processor keeps per request between deltas."""

    client_id: str
    request: GenerateRequest
    detokenizer: IncrementalDetokenizer | NoText
    num_prompt_tokens: int
    index: int = 0  # which of the request's n sequences
    num_output_tokens: int = 0
    text: str = ""  # all decided text (stop strings applied)
    emitted: int = 0  # characters of `text` already sent
    ranked: bool = False  # best_of > n: held back until every sequence has ended
    logprob: float = 0.0  # ranked: the sampled tokens' cumulative logprob
    token_ids: list[int] = field(default_factory=list)  # ranked: every output token
    rows: list = field(default_factory=list)  # ranked: every logprobs row
    prompt_rows: list = field(default_factory=list)  # ranked: every prompt logprobs row
    prompt_token_ids: tuple[int, ...] = ()  # beam search: each output is decoded after it


class TextProcessor:
    """Tokenizes requests on the way in and detokenizes token deltas on the way out.

    `admit(request)` returns an AddRequest for the scheduler, or raises ValueError with a
    message for the client (nothing is kept then). `on_token_delta(delta)` returns the
    client's OutputDelta and, when a stop string ended the request here, an AbortRequest
    for the scheduler. Text that could be the start of a stop string is held back until
    decided, so a client never sees text that a stop string later removes. A request
    sampling several sequences keeps one state per sequence (keyed by `sequence_id`); its
    deltas go out under the request's id with the sequence's `index`. With best_of > n
    nothing streams: once every sequence has ended, the n of highest cumulative logprob
    go out whole, best first. A beam search streams nothing either: the engine ranks its
    outputs and sends them whole (`on_ranked`).

    Stop strings follow vLLM: one is looked for only once the sequence has `min_tokens`
    output tokens, and one found in text flushed at the end still ends it with "stop".
    Without a tokenizer (`skip_tokenizer_init`) prompts must be token ids, and outputs
    carry token ids only (empty text, no decoded logprob tokens).

    `check_grammar` (injected: engine/wiring.py gives the grammar backend's checker)
    refuses a `structured_outputs` constraint that cannot compile for this engine, with
    a StructuredOutputsError (a ValueError) naming the field, as `prepare` refuses any
    invalid request; without one, constraints are only checked where they compile.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        limits: RequestLimits,
        check_grammar: Callable[[StructuredOutputsParams], None] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.check_grammar = check_grammar
        self.states: dict[str, _TextState] = {}  # by sequence id
        self.sequences: dict[str, list[str]] = {}  # request id -> its sequence ids
        self.clients: dict[str, str] = {}  # request id -> its client id
        self.ranked: dict[str, list[tuple[float, OutputDelta]]] = {}  # ended, held back
        self.token_texts = None if tokenizer is None else TokenTexts(tokenizer)  # logprobs

    def admit(self, request: GenerateRequest, arrival_time: float) -> AddRequest:
        """`prepare` then `register`."""
        return self.register(request, self.prepare(request), arrival_time)

    def render(self, request: GenerateRequest) -> str | None:
        """A chat request's rendered prompt text (None for other requests), for `prepare`;
        ValueError naming the field. Read-only like `prepare`: the actor renders on
        threads of their own, so a template that takes its whole deadline holds up no
        other request's tokenizing."""
        if request.messages is None or self.tokenizer is None:
            return None
        return self._render_chat(request.messages, True, request.template_args)

    def prepare(self, request: GenerateRequest, rendered: str | None = None) -> list[int]:
        """The request's prompt token ids, checked against the limits (ValueError naming
        the field otherwise); a chat's from `rendered` (`render`) when given. Reads no
        state and keeps none: it may run on any thread, beside the other methods (the
        slow part of admission: tokenizing)."""
        token_ids = self._token_ids(request, rendered)
        field = "messages" if request.messages is not None else "prompt"
        strict = request.strict_max_tokens
        validate_request(token_ids, request.params, self.limits, field, strict_max_tokens=strict)
        constraint = request.params.structured_outputs
        if constraint is not None and self.check_grammar is not None:
            self.check_grammar(constraint)
        return token_ids

    def tokenize(self, request: TokenizeRequest | DetokenizeRequest) -> TokenizeResult:
        """The answer to a tokenize or detokenize request (`error` set, naming the field,
        for input refused). Reads no state and keeps none, like `prepare`. Input that
        cannot fit the context whatever its tokens is refused before any tokenizing, as
        generation requests are (a text that fits or nearly does is tokenized, so a
        client can learn its count)."""
        rid = request.request_id
        try:
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (skip_tokenizer_init)")
            if isinstance(request, DetokenizeRequest):
                ids = self._known_ids(request.token_ids)
                text = self.tokenizer.decode(ids, request.skip_special_tokens)
            else:
                ids, text = self._encode(request), ""
        except ValueError as exc:
            return TokenizeResult.refused(rid, str(exc), ErrorKind.INVALID)
        texts = tuple(map(self.token_texts, ids))
        return TokenizeResult(request_id=rid, token_ids=tuple(ids), token_strs=texts, text=text)

    def _encode(self, request: TokenizeRequest) -> list[int]:
        if (request.prompt is None) == (request.messages is None):
            raise ValueError("set exactly one of prompt, messages")
        if request.prompt is not None:
            return self._encode_prompt(request.prompt, request.add_special_tokens)
        text = self._render_chat(
            request.messages, request.add_generation_prompt, request.template_args
        )
        return self.tokenizer.encode_chat(text)

    def _known_ids(self, token_ids: tuple[int, ...]) -> list[int]:
        """`token_ids` if the tokenizer has every one, else ValueError naming `tokens`."""
        if len(token_ids) > self.limits.max_model_len:
            raise ValueError(
                f"tokens: {len(token_ids):,} token ids, more than this model's context "
                f"(max_model_len) of {self.limits.max_model_len:,}"
            )
        size = self.tokenizer.vocab_size
        bad = [t for t in token_ids if not 0 <= t < size]
        if bad:
            raise ValueError(
                f"tokens: token ids must be in [0, {size}) (this tokenizer's vocabulary); "
                f"got {bad[:5]}"
            )
        return list(token_ids)

    def count_prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        """How many prompt tokens chat `messages` render to (template and generation
        prompt), as a request with them would count; a text too long for the context
        whatever its tokens gets a lower bound (already over the context) and is not
        tokenized. Read-only, like `prepare`."""
        if self.tokenizer is None:
            raise ValueError("messages need a tokenizer; this engine has none")
        too_long = self._too_long(sum(len(m["content"]) for m in messages))
        if too_long is not None:
            return too_long
        text = self.tokenizer.render_chat(messages, add_generation_prompt=True)
        too_long = self._too_long(len(text))
        return too_long if too_long is not None else len(self.tokenizer.encode_chat(text))

    def register(
        self, request: GenerateRequest, token_ids: list[int], arrival_time: float
    ) -> AddRequest:
        """Starts keeping the prepared request's text state; the AddRequest for it."""
        params = request.params
        k = 1 if params.use_beam_search else params.num_sequences
        ids = (
            [request.request_id]
            if k == 1
            else [sequence_id(request.request_id, i) for i in range(k)]
        )
        for rid in {request.request_id, *ids}:
            if rid in self.sequences or rid in self.states:
                raise ValueError(f"request_id {rid!r} is already in flight")
        self.sequences[request.request_id] = ids
        self.clients[request.request_id] = request.client_id
        ranked = k > params.n
        beams = tuple(token_ids) if params.use_beam_search else ()  # decoded after the prompt
        for index, seq_id in enumerate(ids):
            detokenizer = self._detokenizer(token_ids, params)
            self.states[seq_id] = _TextState(
                request.client_id,
                request,
                detokenizer,
                len(token_ids),
                index,
                ranked=ranked,
                prompt_token_ids=beams,
            )
        return AddRequest(request.request_id, tuple(token_ids), params, arrival_time)

    def _detokenizer(self, token_ids, params) -> IncrementalDetokenizer | NoText:
        if self.tokenizer is None:
            return NoText()
        return IncrementalDetokenizer(
            self.tokenizer,
            token_ids,
            params.skip_special_tokens,
            params.spaces_between_special_tokens,
        )

    def on_ranked(
        self, ranked: tuple[RankedSequence, ...], prompt: tuple[RequestLogprobs, ...]
    ) -> list[tuple[str, OutputDelta]]:
        """A finished beam search's outputs, each decoded whole, for its client (the
        request's prompt logprobs ride on output 0); the request is then forgotten."""
        prompt_rows = {lp.request_id: lp.rows for lp in prompt}
        outs = []
        for seq in ranked:
            state = self.states.get(seq.request_id)
            if state is None:
                continue  # aborted meanwhile
            detokenizer = self._detokenizer(state.prompt_token_ids, state.request.params)
            text = detokenizer.append(list(seq.token_ids)) + detokenizer.flush()
            rows = prompt_rows.get(seq.request_id) if seq.index == 0 else None
            out = OutputDelta.ranked(
                seq.request_id,
                seq.index,
                text,
                seq.token_ids,
                seq.finish_reason,
                state.num_prompt_tokens,
                self._decode_rows(rows),
            )
            outs.append((state.client_id, out))
        for request_id in {seq.request_id for seq in ranked}:
            self.drop(request_id)
        return outs

    def _token_ids(self, request: GenerateRequest, rendered: str | None) -> list[int]:
        given = [
            x is not None for x in (request.prompt, request.prompt_token_ids, request.messages)
        ]
        if sum(given) != 1:
            raise ValueError("set exactly one of prompt, prompt_token_ids, messages")
        if self.tokenizer is None and request.prompt_token_ids is None:
            raise ValueError(
                "prompt is text but the tokenizer is disabled (skip_tokenizer_init); pass token ids"
            )
        if request.prompt is not None:
            return self._encode_prompt(request.prompt, add_special_tokens=True)
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if rendered is None:
            rendered = self.render(request)
        return self.tokenizer.encode_chat(rendered)

    def _encode_prompt(self, prompt: str, add_special_tokens: bool) -> list[int]:
        """A text prompt's ids; refused by name when it cannot fit, before tokenizing."""
        check_text("prompt", prompt)
        self._check_length("prompt", len(prompt))
        return self.tokenizer.encode(prompt, add_special_tokens)

    def _render_chat(
        self,
        messages: tuple[ChatMessage, ...],
        add_generation_prompt: bool,
        template_args: ChatTemplateArgs | None,
    ) -> str:
        """The chat's text; refused when its messages, or what the template makes of
        them (it can write more than they hold), cannot fit the context: before the
        work of rendering, then before the work of tokenizing."""
        self._check_length("messages", sum(len(m.content) for m in messages))
        dicts, variables = ChatPrompt(messages, template_args).template_inputs()
        text = self.tokenizer.render_chat(dicts, add_generation_prompt, variables)
        too_long = self._too_long(len(text))
        if too_long is not None:
            raise ValueError(
                f"messages render to {len(text):,} characters of prompt, so at least "
                f"{too_long:,} tokens; this model's context (max_model_len) is "
                f"{self.limits.max_model_len:,} tokens"
            )
        return text

    def _check_length(self, name: str, num_chars: int) -> None:
        """Refuses text too long for the context whatever its tokens, before the work
        of tokenizing it (a megabyte takes about a second)."""
        too_long = self._too_long(num_chars)
        if too_long is not None:
            raise ValueError(
                f"{name} has {num_chars:,} characters, so at least {too_long:,} tokens (no "
                f"token of this model covers more than {self.tokenizer.max_token_chars} "
                f"characters); this model's context (max_model_len) is "
                f"{self.limits.max_model_len:,} tokens"
            )

    def _too_long(self, num_chars: int) -> int | None:
        """For a text of `num_chars` characters that cannot fit the context whatever its
        tokens, a lower bound on its tokens (at least max_model_len); else None."""
        per_token = self.tokenizer.max_token_chars
        if num_chars >= self.limits.max_model_len * per_token:
            return num_chars // per_token
        return None

    def client_of(self, request_id: str) -> str | None:
        """The client of a request or of one of its sequences (None: not in flight)."""
        state = self.states.get(request_id)
        return self.clients.get(request_id) if state is None else state.client_id

    def request_of(self, sequence_id: str) -> str:
        """The request a sequence belongs to (the id itself when it is not one)."""
        state = self.states.get(sequence_id)
        return sequence_id if state is None else state.request.request_id

    def on_token_delta(self, delta: TokenDelta) -> tuple[list[OutputDelta], AbortRequest | None]:
        """The client's deltas (none while held back) and an abort for the scheduler
        when a stop string ended the sequence here."""
        state = self.states.get(delta.request_id)
        if state is None:
            return [], None  # ended here already (stop string or abort)
        state.num_output_tokens += len(delta.token_ids)
        new = state.detokenizer.append(list(delta.token_ids))
        if delta.finish_reason is not None:
            new += state.detokenizer.flush()
        finish, stop_reason, abort = delta.finish_reason, delta.stop_reason, None
        state.text += new
        params = state.request.params
        match = None
        if params.stop and state.num_output_tokens >= params.min_tokens:
            match = find_stop(state.text, len(new), params.stop, params.include_stop_str_in_output)
        if match is not None:
            state.text = state.text[: match.truncate_to]
            finish, stop_reason = "stop", match.stop
            if delta.finish_reason is None:
                abort = AbortRequest(delta.request_id)
        decided = len(state.text)
        if finish is None and params.stop:
            decided -= hold_back(state.text, params.stop)
        text, state.emitted = state.text[state.emitted : decided], max(state.emitted, decided)
        out = OutputDelta(
            request_id=state.request.request_id,
            text=text,
            token_ids=delta.token_ids,
            finish_reason=finish,
            stop_reason=stop_reason,
            num_prompt_tokens=state.num_prompt_tokens,
            num_output_tokens=state.num_output_tokens,
            error=None,
            logprobs=self._decode_rows(delta.logprobs),
            prompt_logprobs=self._decode_rows(delta.prompt_logprobs),
            index=state.index,
            kv_transfer_params=delta.kv_transfer_params,
        )
        if state.ranked:
            return self._hold_back(state, delta, out), abort
        if finish is not None:
            del self.states[delta.request_id]
            self._forget_if_done(state.request.request_id)
        return [out], abort

    def _hold_back(self, state: _TextState, delta: TokenDelta, out: OutputDelta) -> list:
        """best_of > n: keeps the sequence's tokens and logprob; once all have ended,
        the n best, whole, renumbered from 0 (their logprobs only when asked for)."""
        state.token_ids += delta.token_ids
        state.logprob += sum(row[0].logprob for row in delta.logprobs or ())
        state.rows += out.logprobs or ()
        state.prompt_rows += out.prompt_logprobs or ()
        if out.finish_reason is None:
            return []
        request = state.request
        whole = replace(
            out,
            text=state.text,
            token_ids=tuple(state.token_ids),
            logprobs=None if request.params.logprobs is None else tuple(state.rows),
            prompt_logprobs=tuple(state.prompt_rows) or None,
        )
        self.ranked.setdefault(request.request_id, []).append((state.logprob, whole))
        del self.states[delta.request_id]
        if not self._forget_if_done(request.request_id):
            return []
        ended = self.ranked.pop(request.request_id)
        prompt_rows = next((d.prompt_logprobs for _, d in ended if d.prompt_logprobs), None)
        # best_of's rule: the n of highest cumulative logprob, best first (ties: as ended)
        best = sorted(ended, key=lambda r: r[0], reverse=True)[: request.params.n]
        # the prompt's rows (scored by one sequence) ride on output 0, whichever is best
        return [
            replace(d, index=i, prompt_logprobs=prompt_rows if i == 0 else None)
            for i, (_, d) in enumerate(best)
        ]

    def _forget_if_done(self, request_id: str) -> bool:
        """Drops the request once none of its sequences is open; True if it did."""
        if any(s in self.states for s in self.sequences.get(request_id, ())):
            return False
        self.sequences.pop(request_id, None)
        self.clients.pop(request_id, None)
        return True

    def _decode_rows(self, rows: tuple[LogprobRow, ...] | None) -> tuple[LogprobRow, ...] | None:
        """Fills in each candidate's text: what it adds after the text before it."""
        if rows is None:
            return None
        return tuple(
            tuple(replace(c, decoded_token=self._token_text(c.token_id)) for c in row)
            for row in rows
        )

    def _token_text(self, token_id: int) -> str | None:
        """The text the token adds to the text before it (special tokens kept), so a
        sequence's logprob tokens join into its text."""
        return None if self.token_texts is None else self.token_texts(token_id)

    def drop(self, request_id: str) -> None:
        """Forget a request (client abort), every sequence of it."""
        self.clients.pop(request_id, None)
        for seq_id in self.sequences.pop(request_id, [request_id]):
            self.states.pop(seq_id, None)
        self.ranked.pop(request_id, None)
