"""Piecewise CUDA graphs: the model's forward split at its attention calls, each piece
between them replayed from a CUDA graph captured per padded token count, attention run
eagerly between the pieces (its metadata changes every step; the pieces' shapes do
not, once padded).

How: `torch.compile` (dynamic shapes) traces the forward with every attention backend
wrapped in an `OpaqueBackend` (engine/worker/compiled_model.py), whose call dynamo
never enters, so the trace breaks there into pieces (and at fused MoE layers, which
read their routing on the host); the compile backend here turns
each piece into a `GraphPiece`. A step of T tokens is padded to the smallest capture
size S >= T (`cudagraph_capture_sizes`; past the largest the step runs eagerly): the
padding tokens have input id 0, position 0 and no KV slot (the attention wrapper runs
the backend on the T real tokens only and gives the padding rows zeros), and the hidden
states of the T real tokens are returned. On CUDA a `GraphPiece` runs its piece
eagerly the first time it sees a call's signature (warm-up), captures a CUDA graph the
second time, and replays it after that, copying into the captured inputs only the
activations whose storage moved. Dynamo compiles a piece per code location, so one piece
serves every layer (each passing its own weights): the signature holds the call's place
in the forward, the shapes, and the storage of the model's own tensors (weights,
buffers), so each layer has its own graph and outputs and a weight is never copied
into; a piece without device work (views only) runs as a plain call. Dynamo's cache is
cleared when a model is split, so no other model's pieces answer for it. All graphs
share one memory pool. On the CPU
the same split and padding run with plain calls in place of graphs: the path CI
checks, and `GraphMode.EMULATED` holds the pieces to a CUDA graph's contract there.
The runner builds this when `cudagraph_capture_sizes` is given (and not
`enforce_eager`): opt-in, as the hybrid and windowed families have not run captured
on a GPU yet (docs/performance.md).
"""

from __future__ import annotations

import bisect
import enum
import logging
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

from engine.config import check_capture_sizes
from engine.worker.compiled_model import wrap_attention_backends
from engine.worker.models.fused_moe import FusedMoE

logger = logging.getLogger(__name__)
DEFAULT_CAPTURE_SIZES = (1, 2, 4, *range(8, 257, 8))  # vLLM's default shape, up to 256


def capture_sizes(sizes: Sequence[int] | None, max_num_batched_tokens: int) -> tuple[int, ...]:
    """The token counts to capture: `sizes` (validated), or the defaults up to the
    step's token budget."""
    if sizes is None:
        return tuple(s for s in DEFAULT_CAPTURE_SIZES if s <= max_num_batched_tokens)
    check_capture_sizes(sizes)
    return tuple(sorted(set(sizes)))


def run_host_synced_layers_eagerly(model: nn.Module) -> None:
    """A fused MoE layer reads its per-expert token counts on the host to slice the
    tokens by expert: no CUDA graph can hold that, so its forward runs eagerly
    between the pieces, as attention does (it sees the padded rows: their outputs are
    dropped with the rest of the padding, and they count in `tokens_per_expert`)."""
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.forward = torch.compiler.disable(module.forward)


def static_storage(model: nn.Module) -> frozenset[int]:
    """The storage pointers of `model`'s own tensors: parameters, buffers and tensors
    kept as module attributes (prepacked weights, rotary tables)."""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
    return frozenset(t.untyped_storage().data_ptr() for t in tensors)


class GraphMode(enum.Enum):
    """How the pieces run: plain calls (the CPU), CUDA graphs, or a CUDA graph's
    semantics emulated with plain calls (tests: fixed inputs and outputs, replays that
    read only what capture kept)."""

    PLAIN = "plain"
    CUDA = "cuda"
    EMULATED = "emulated"


class EmulatedGraph:
    """A captured CUDA graph's contract on any device: `replay` recomputes `fn` from the
    inputs kept at capture into the outputs made at capture, whatever the caller holds."""

    def __init__(self, fn: Callable, inputs: list, out) -> None:
        self.fn, self.inputs, self.out = fn, inputs, out

    def replay(self) -> None:
        for static, fresh in zip(self.out, self.fn(*self.inputs), strict=True):
            if isinstance(static, torch.Tensor):
                static.copy_(fresh)


class CallOrder:
    """Which piece call of the current forward this is (1, 2, ...): one piece serves
    every layer, and each layer's call keeps its own graph and outputs."""

    def __init__(self) -> None:
        self.position = 0

    def next(self) -> int:
        self.position += 1
        return self.position


class GraphPiece:
    """One piece of the split forward (`fn`, an FX graph between attention calls). With
    graphs: per call signature, warm up, then capture, then replay; else a plain call.
    A signature is the call's place in the forward (`order`), each argument's shape,
    and for a tensor on the model's own storage (`static`: weights, buffers) that
    storage too: such a tensor is never copied into, a call with another one (another
    layer's weights) is another graph."""

    def __init__(
        self, fn: Callable, mode: GraphMode, pool, static: frozenset[int], order: CallOrder
    ) -> None:
        self.fn = fn
        self.mode = mode
        self.pool = pool
        self.static = static
        self.order = order
        self.num_calls = 0
        self.num_replays = 0
        self._seen: set[tuple] = set()
        self._uncapturable: set[tuple] = set()
        self._graphs: dict[tuple, tuple[object, list, object]] = {}

    def __call__(self, *args):
        self.num_calls += 1
        if self.mode is GraphMode.PLAIN:
            return self.fn(*args)
        key = (self.order.next(), *(self._signature(a) for a in args))
        captured = self._graphs.get(key)
        if captured is not None:
            return self._replay(captured, args)
        if key not in self._seen or key in self._uncapturable:  # warm-up, or eager for good
            self._seen.add(key)
            return self.fn(*args)
        captured = self._capture(args)
        if captured is None:
            self._uncapturable.add(key)
            return self.fn(*args)
        self._graphs[key] = captured
        captured[0].replay()
        return captured[2]

    def _capture(self, args) -> tuple[object, list, object] | None:
        """(graph, the inputs it reads, the outputs it writes), or None: stays eager."""
        if self.mode is GraphMode.EMULATED:
            clones = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            graph = EmulatedGraph(self.fn, list(args), self.fn(*clones))
            return graph, graph.inputs, graph.out
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: other threads' CUDA work (a KV load's write) goes on meanwhile
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    out = self.fn(*args)
        except RuntimeError as exc:  # e.g. a host sync inside the piece
            logger.warning("a forward piece cannot be captured as a CUDA graph: %s", exc)
            return None
        if any("Graph is empty" in str(w.message) for w in caught):  # views only: a call
            return None
        return graph, list(args), out

    def _signature(self, arg) -> object:
        if not isinstance(arg, torch.Tensor):
            return arg  # a size (dynamic shapes pass the token count)
        storage = arg.untyped_storage().data_ptr()
        return (tuple(arg.shape), arg.data_ptr() if storage in self.static else None)

    def _replay(self, captured, args):
        graph, inputs, out = captured
        for held, arg in zip(inputs, args, strict=True):
            if isinstance(arg, torch.Tensor) and arg.data_ptr() != held.data_ptr():
                held.copy_(arg)  # an activation (weights are in the signature)
        graph.replay()
        self.num_replays += 1
        return out


class PiecewiseGraphs:
    """`model`'s forward, split at attention and replayed from graphs per padded size
    (`sizes`, ascending); `__call__` has the model's forward signature. `mode`: CUDA
    graphs on a CUDA device, plain calls elsewhere, unless given."""

    def __init__(
        self,
        model: nn.Module,
        sizes: Sequence[int],
        device: str | torch.device,
        mode: GraphMode | None = None,
    ) -> None:
        self.sizes = tuple(sorted(sizes))
        on_cuda = torch.device(device).type == "cuda"
        self.mode = mode or (GraphMode.CUDA if on_cuda else GraphMode.PLAIN)
        self.pool = torch.cuda.graph_pool_handle() if self.mode is GraphMode.CUDA else None
        self.pieces: list[GraphPiece] = []
        self.eager = model.forward
        self.static = static_storage(model)
        self.order = CallOrder()
        wrap_attention_backends(model)
        run_host_synced_layers_eagerly(model)
        # dynamo caches compiled frames per code object, and another model's pieces
        # (its graphs, its weights) could answer for this one's: start from none
        torch._dynamo.reset()
        self.compiled = torch.compile(model.forward, backend=self._split, dynamic=True)

    def _split(self, graph_module: torch.fx.GraphModule, example_inputs) -> Callable:
        piece = GraphPiece(graph_module.forward, self.mode, self.pool, self.static, self.order)
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
        self.order.position = 0
        hidden = self.compiled(input_ids, positions, kv_cache, metadata)  # [S, hidden]
        return hidden[:num_tokens]
