"""Piecewise CUDA graphs: the model's forward split at its attention calls, each piece
between them replayed from a CUDA graph captured per padded token count, attention run
eagerly between the pieces (its metadata changes every step; the pieces' shapes do
not, once padded).

How: `torch.compile` (dynamic shapes) traces the forward with every attention backend
wrapped in an `OpaqueBackend` (engine/worker/compiled_model.py), whose call dynamo
never enters, so the trace breaks there into pieces; the compile backend here turns
each piece into a `GraphPiece`. A step of T tokens is padded to the smallest capture
size S >= T (`cudagraph_capture_sizes`; past the largest the step runs eagerly): the
padding tokens have input id 0, position 0 and no KV slot (the attention wrapper runs
the backend on the T real tokens only and gives the padding rows zeros), and the hidden
states of the T real tokens are returned. On CUDA a `GraphPiece` runs its piece
eagerly the first time it sees a shape (warm-up), captures a CUDA graph the second
time, and replays it after that, copying into the captured inputs only the tensors
whose storage moved (activations; weights and KV caches stay put); all graphs share one
memory pool, so the pieces cost little more than one step's activations. On the CPU
the same split and padding run with plain calls in place of graphs: the path CI
checks. The runner builds this when `cudagraph_capture_sizes` is given (and not
`enforce_eager`); CUDA capture awaits a GPU run before it becomes the default there.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from engine.config import check_capture_sizes
from engine.worker.compiled_model import wrap_attention_backends

logger = logging.getLogger(__name__)
DEFAULT_CAPTURE_SIZES = (1, 2, 4, *range(8, 257, 8))  # vLLM's default shape, up to 256


def capture_sizes(sizes: Sequence[int] | None, max_num_batched_tokens: int) -> tuple[int, ...]:
    """The token counts to capture: `sizes` (validated), or the defaults up to the
    step's token budget."""
    if sizes is None:
        return tuple(s for s in DEFAULT_CAPTURE_SIZES if s <= max_num_batched_tokens)
    check_capture_sizes(sizes)
    return tuple(sorted(set(sizes)))


class GraphPiece:
    """One piece of the split forward (`fn`, an FX graph between attention calls). On
    CUDA: per input signature, warm up, then capture, then replay; elsewhere: call."""

    def __init__(self, fn: Callable, use_graphs: bool, pool) -> None:
        self.fn = fn
        self.use_graphs = use_graphs
        self.pool = pool
        self.num_calls = 0
        self.num_replays = 0
        self._seen: set[tuple] = set()
        self._uncapturable: set[tuple] = set()
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list, object]] = {}

    def __call__(self, *args):
        self.num_calls += 1
        if not self.use_graphs:
            return self.fn(*args)
        key = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
        captured = self._graphs.get(key)
        if captured is not None:
            return self._replay(captured, args)
        if key not in self._seen or key in self._uncapturable:  # warm-up, or eager for good
            self._seen.add(key)
            return self.fn(*args)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: other threads' CUDA work (a KV load's write) goes on meanwhile
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = self.fn(*args)
        except RuntimeError as exc:  # e.g. a host sync inside the piece: it stays eager
            logger.warning("a forward piece cannot be captured as a CUDA graph: %s", exc)
            self._uncapturable.add(key)
            return self.fn(*args)
        self._graphs[key] = (graph, list(args), out)
        graph.replay()
        return out

    def _replay(self, captured, args):
        graph, inputs, out = captured
        for held, arg in zip(inputs, args, strict=True):
            if isinstance(arg, torch.Tensor) and arg.data_ptr() != held.data_ptr():
                held.copy_(arg)  # an activation: into the captured input's storage
        graph.replay()
        self.num_replays += 1
        return out


class PiecewiseGraphs:
    """`model`'s forward, split at attention and replayed from graphs per padded size
    (`sizes`, ascending); `__call__` has the model's forward signature."""

    def __init__(self, model: nn.Module, sizes: Sequence[int], device: str | torch.device) -> None:
        self.sizes = tuple(sorted(sizes))
        self.use_graphs = torch.device(device).type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.pieces: list[GraphPiece] = []
        self.eager = model.forward
        wrap_attention_backends(model)
        self.compiled = torch.compile(model.forward, backend=self._split, dynamic=True)

    def _split(self, graph_module: torch.fx.GraphModule, example_inputs) -> Callable:
        piece = GraphPiece(graph_module.forward, self.use_graphs, self.pool)
        self.pieces.append(piece)
        return piece

    def padded_size(self, num_tokens: int) -> int | None:
        """The capture size a step of `num_tokens` runs at (None: past the largest)."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache, metadata):
        num_tokens = input_ids.shape[0]  # [T]
        size = self.padded_size(num_tokens)
        if size is None or num_tokens == 0:
            return self.eager(input_ids, positions, kv_cache, metadata)
        pad = size - num_tokens
        input_ids = torch.nn.functional.pad(input_ids, (0, pad))  # [S]
        positions = torch.nn.functional.pad(positions, (0, pad))
        hidden = self.compiled(input_ids, positions, kv_cache, metadata)  # [S, hidden]
        return hidden[:num_tokens]
