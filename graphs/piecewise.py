"""Piecewise compilation: the model graph split at attention, each piece compiled and graphed.

The model traces as one graph in which every attention call is one opaque `libkk::attention` op
(libkk/layers/attention.py). `PiecewiseBackend` is a torch.compile backend that splits that graph
at each attention op into pieces, compiles every piece between two attention calls with Inductor,
and wraps it in a `PieceGraphs`: on CUDA, for a token count in the capture sizes, the piece is
replayed from a CUDA graph while attention runs eagerly in between (attention reads per-step
metadata: lengths, block tables, which a graph could not take). Mixed prefill/decode batches get
graphs this way; FULL graphs (capture.py) stay the faster choice for uniform decode.

A piece's inputs are weights (fixed addresses), outputs of the previous piece (the previous
graph's fixed output) or of attention (a new tensor each call): at replay every input whose
address differs from the captured one is copied into the captured buffer first.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from libkk.graphs.capture import padded_size_table
from torch import fx
from torch.fx.passes.split_module import split_module

logger = logging.getLogger(__name__)

ATTENTION_OPS = ("libkk.attention",)

_enabled = True  # off while a FULL graph captures the whole forward (no graph inside a graph)
_capturing = False  # on while the runner captures: a piece's first call at a size captures it


@contextlib.contextmanager
def pieces_disabled() -> Iterator[None]:
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


@contextlib.contextmanager
def capturing_pieces() -> Iterator[None]:
    global _capturing
    previous, _capturing = _capturing, True
    try:
        yield
    finally:
        _capturing = previous


def _is_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and any(op in str(node.target) for op in ATTENTION_OPS)


def split_at_attention(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str], list[str]]:
    """(the split module, names of the pieces between attention calls, names of the attention
    submodules), in call order. Each attention op gets a submodule of its own."""
    partition, ids = 0, {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if _is_attention(node):
            partition += 1
            ids[node] = partition
            partition += 1
        else:
            ids[node] = partition
    split = split_module(gm, None, lambda n: ids[n], keep_original_order=True)
    pieces, attention = [], []
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(split, node.target)
        is_attn = any(_is_attention(n) for n in sub.graph.nodes)
        (attention if is_attn else pieces).append(node.target)
    return split, pieces, attention


class PieceGraphs:
    """One compiled piece; on CUDA, CUDA graphs of it per token count in `sizes`."""

    def __init__(self, name: str, compiled: Callable[..., Any], sizes: Sequence[int]) -> None:
        self.name = name
        self.compiled = compiled
        self.sizes = set(sizes)
        self.pool: Any = None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, list[Any], Any]] = {}

    def __call__(self, *args: Any) -> Any:
        n = _num_tokens(args)
        if not _enabled or n is None or n not in self.sizes or not torch.cuda.is_available():
            return self.compiled(*args)
        entry = self.graphs.get(n)
        if entry is None:
            if not _capturing:
                return self.compiled(*args)
            return self._capture(n, args)
        graph, inputs, output = entry
        for captured, arg in zip(inputs, args, strict=True):
            if isinstance(arg, torch.Tensor) and arg.data_ptr() != captured.data_ptr():
                captured.copy_(arg)
        graph.replay()
        return output

    def _capture(self, n: int, args: tuple[Any, ...]) -> Any:
        # Inputs that are not fixed (activations) get buffers of their own, so the next replay's
        # copies never write into another piece's output or an attention result.
        inputs = [
            a.clone() if isinstance(a, torch.Tensor) and not _is_static(a) else a for a in args
        ]
        for _ in range(2):  # warm up: compile for this size, settle the allocator
            self.compiled(*inputs)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = self.compiled(*inputs)
        self.graphs[n] = (graph, inputs, output)
        for captured, arg in zip(inputs, args, strict=True):
            if isinstance(arg, torch.Tensor) and arg.data_ptr() != captured.data_ptr():
                captured.copy_(arg)
        graph.replay()
        return output


def _is_static(t: torch.Tensor) -> bool:
    # Parameters and module buffers keep their address; dynamo marks the ones it lifts to graph
    # inputs with `_dynamo_static_input_type`.
    return isinstance(t, torch.nn.Parameter) or hasattr(t, "_dynamo_static_input_type")


def _num_tokens(args: Sequence[Any]) -> int | None:
    """The token count of a piece's call: the leading size of its first activation input."""
    for a in args:
        if isinstance(a, torch.Tensor) and not _is_static(a) and a.dim() >= 1:
            return int(a.shape[0])
    return None


class PiecewiseBackend:
    """torch.compile backend: split at attention, compile pieces, wrap them in PieceGraphs.

    `compile_piece(gm, example_inputs)` compiles one piece (Inductor by default). `pieces` lists
    every PieceGraphs made, so the runner can capture and count them.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        compile_piece: Callable[[fx.GraphModule, list[Any]], Callable[..., Any]] | None = None,
    ) -> None:
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.pad_to = padded_size_table(self.sizes)  # token count -> the size its graphs have
        self.compile_piece = compile_piece or _inductor
        self.pieces: list[PieceGraphs] = []
        self.pool: Any = None

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        split, pieces, attention = split_at_attention(gm)
        names = set(pieces)
        backend, made = self, []

        class _Compile(fx.Interpreter):
            # Runs the split graph on the example (fake) inputs so each piece is compiled for
            # the inputs it really receives.
            def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
                out = super().call_module(target, args, kwargs)
                if target in names:
                    sub = getattr(split, target)
                    compiled = _compile_returning_tuple(backend.compile_piece, sub, list(args))
                    piece = PieceGraphs(target, compiled, backend.sizes)
                    piece.pool = backend.pool
                    made.append(piece)
                    setattr(split, target, _Wrapped(piece))
                return out

        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        if fake_mode is None:
            fake_mode = torch._subclasses.FakeTensorMode()
        # Real inputs (parameters, buffers) become fakes of the same mode as the activations.
        fake_inputs = [
            fake_mode.from_tensor(t)
            if isinstance(t, torch.Tensor) and not isinstance(t, torch._subclasses.FakeTensor)
            else t
            for t in example_inputs
        ]
        # NOTE: dynamo may restart its analysis from inside this run (e.g. to specialize a float
        # input); only a finished split's pieces are kept.
        with fake_mode:
            _Compile(split).run(*fake_inputs)
        self.pieces.extend(made)
        logger.info(
            "piecewise graph: %d pieces between %d attention calls", len(pieces), len(attention)
        )
        return split


class _Wrapped(torch.nn.Module):
    # A PieceGraphs as a submodule of the split GraphModule (call_module nodes need a Module).
    def __init__(self, piece: PieceGraphs) -> None:
        super().__init__()
        self.piece = piece

    def forward(self, *args: Any) -> Any:
        return self.piece(*args)


def _compile_returning_tuple(
    compile_piece: Callable[[fx.GraphModule, list[Any]], Callable[..., Any]],
    gm: fx.GraphModule,
    example_inputs: list[Any],
) -> Callable[..., Any]:
    """Compiles a piece whose graph returns one value as a graph returning a 1-tuple (what the
    AOT compilers require), and unwraps the result again."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return compile_piece(gm, example_inputs)
    output.args = ((output.args[0],),)
    gm.recompile()
    compiled = compile_piece(gm, example_inputs)
    return lambda *args: compiled(*args)[0]


def _inductor(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)
