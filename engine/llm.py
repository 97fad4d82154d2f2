"""The offline API: `LLM(model=...).generate(prompts, params)` and `.chat(...)`."""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from engine.core.stats import EngineStats
from engine.engine_args import EngineArgs
from engine.in_process import InProcessEngine, Prompt
from engine.logging_setup import configure_logging
from engine.messages import ChatPrompt
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.wiring import build_engine
from engine.worker.parallel.offline_ranks import OfflineRanks, RelayingWorker
from engine.worker.worker import build_worker

Messages = list[dict[str, Any]]
logger = logging.getLogger(__name__)


class LLM:
    """Batch generation over the paged engine, with vLLM's keyword arguments.

    `generate` accepts one prompt or a list (strings or token-id lists) and one
    SamplingParams or one per prompt; it returns one RequestOutput per prompt, in input
    order. Invalid prompts or params raise ValueError before anything is queued.

    It runs the served engine in-process (`InProcessEngine`: the same text processor,
    engine core and worker as `pagedserve serve`), so both give the same outputs;
    `pipeline_depth=2` plans one step ahead as the server does.

    `tensor_parallel_size=N` splits the model over N ranks, `pipeline_parallel_size=S`
    its layers into S stages (N x S ranks): rank 0 (the last stage's first) runs here,
    the others in processes of their own (`engine/worker/parallel/offline_ranks.py`);
    `close()` (or leaving a `with LLM(...)` block) stops them.
    """

    def __init__(self, model: str, pipeline_depth: int = 1, **kwargs: Any) -> None:
        configure_logging()
        args = EngineArgs(model=model, **kwargs)
        self.config = args.build()  # a model the ranks cannot split is refused here
        self._ranks = None
        if self.config.parallel.world_size > 1:
            args, self._ranks = OfflineRanks.start(args)
            parallel = replace(
                self.config.parallel, distributed_init_method=args.distributed_init_method
            )
            self.config = replace(self.config, parallel=parallel)
        try:
            self._start(args, pipeline_depth)
        except BaseException:
            if self._ranks is not None:
                self._ranks.abandon()
            raise

    def _start(self, args: EngineArgs, pipeline_depth: int) -> None:
        m = self.config.model
        logger.info(
            "LLM: %s (%s, %s, max_model_len %d) on %s",
            m.model,
            m.architecture,
            str(m.dtype).removeprefix("torch."),
            m.max_model_len,
            self.config.device.device,
        )
        worker, ready = build_worker(args, config=self.config)
        if self._ranks is not None:
            worker = RelayingWorker(worker, self._ranks)
            weakref.finalize(self, worker.close)  # at the latest when the program ends
        logger.info(
            "LLM ready: %d KV blocks of %d tokens, %d CPU swap blocks, %s attention",
            ready.num_blocks,
            ready.block_size,
            ready.num_cpu_blocks,
            ready.attention_backend,
        )
        self.engine = InProcessEngine(build_engine(self.config, ready), worker, pipeline_depth)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops the other tensor-parallel ranks (nothing to do with one); idempotent."""
        if isinstance(self.engine.worker, RelayingWorker):
            self.engine.worker.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        return self._run(prompt_list, params, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        *,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to one conversation or a list of them.
        `tools` (OpenAI's list of function tools) and `chat_template_kwargs` (extra
        template variables, e.g. `{"enable_thinking": False}`) reach the template as in
        vLLM's `LLM.chat`; messages may hold assistant `tool_calls` and `tool` turns."""
        if self.engine.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this LLM was built with skip_tokenizer_init")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:
            chat = ChatPrompt.of(list(conv), tools=tools, chat_template_kwargs=chat_template_kwargs)
            dicts, variables = chat.template_inputs()
            tokenizer = self.engine.tokenizer
            prompts.append(tokenizer.apply_chat_template(dicts, add_generation_prompt, variables))
        params = _as_params_list(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def expert_load(self) -> list[list[int]]:
        """A mixture of experts' load: per MoE layer, the (token, expert) assignments each
        expert got so far (empty for a dense model). With expert parallelism, an expert's
        count is its rank's work."""
        worker = getattr(self.engine.worker, "worker", self.engine.worker)
        return worker.runner.expert_load()

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix; returns how many cached blocks were dropped."""
        return self.engine.reset_prefix_cache()

    def _run(
        self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, p in zip(ids, prompts, params, strict=True):
                self.engine.add_request(rid, prompt, p)
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        outputs: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    outputs[out.request_id] = out
                    bar.update(1)
        self.engine.flush()
        return [outputs[rid] for rid in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single token-id prompt
    return prompts


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; pass one or {n}")
    return params
