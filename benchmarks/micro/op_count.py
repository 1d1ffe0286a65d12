"""Blocks and operators: every block's forward runs inside its smlp.profiling.BLOCKS range, and the operators of a
step are counted by phase and block (the step breakdown's, benchmarks/micro/step_breakdown.py).

An operator is what reaches the kernels (a TorchDispatchMode below autograd: aten's and the collectives', not the
profiler's range marks). A forward operator counts for the innermost block running; a backward one for the block
whose forward created the autograd node that runs it (each block's span of autograd sequence numbers is marked on
entry and exit), a gradient accumulation for the block that owns the parameter.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable

import torch
from torch.profiler import record_function
from torch.utils._python_dispatch import TorchDispatchMode

from smlp.gmlp import GMLPBlock
from smlp.lm import LanguageModel
from smlp.moe import SparseBlock, TMoE
from smlp.profiling import BLOCKS
from smlp.token_routed import TokenRoutedGMLPBlock
from smlp.transformer import TransformerBlock


def block_kinds(model) -> list[tuple[object, str, bool]]:
    """(module, block kind of BLOCKS, whether the module is one block of its kind) for every module of `model` that
    opens a block range (a Transformer block's norm opens its attention's range but is no block of its own)."""
    out, kinds = [], ((LanguageModel, "embedding_head"), ((GMLPBlock, TokenRoutedGMLPBlock), "gmlp_block"),
                      (SparseBlock, "smoe"), (TMoE, "tmoe"))
    for module in model.modules():
        if kind := next((k for cls, k in kinds if isinstance(module, cls)), None):
            out.append((module, kind, True))
        elif isinstance(module, TransformerBlock):
            dense = not isinstance(module.ffn, TMoE)
            out += [(module, "ffn" if dense else "tmoe", dense), (module.norm1, "attention", False),
                    (module.attn, "attention", True)]
    return out


@contextlib.contextmanager
def block_ranges(model, listener: Callable[[str, str], None] | None = None):
    """Within the block, every block's `forward` and `step` (cached decoding) runs inside its BLOCKS range;
    `listener(event, kind)`, if given, hears ("enter", kind) and ("exit", kind) around each call."""
    def in_range(method, kind):
        def run(*args, **kwargs):
            with record_function(BLOCKS[kind]):
                if listener is not None:
                    listener("enter", kind)
                try:
                    return method(*args, **kwargs)
                finally:
                    if listener is not None:
                        listener("exit", kind)
        return run

    wrapped = []
    for module, kind, _ in block_kinds(model):
        for method in ("forward", "step"):
            if getattr(module, method, None) is not None and method not in vars(module):
                setattr(module, method, in_range(getattr(module, method), kind))
                wrapped.append((module, method))
    try:
        yield
    finally:
        for module, method in wrapped:
            delattr(module, method)


class OpCounter(TorchDispatchMode):
    """Operators by (phase, block) (module docstring); `within(phase)` is the training loop's phase marker, the
    counter itself block_ranges' listener."""

    def __init__(self, model):
        super().__init__()
        self.counts: Counter = Counter()
        self.phase: str | None = None
        self.blocks: list[tuple[str, int]] = []
        self.spans: list[tuple[int, int, str]] = []
        self.param_block = {p: kind for module, kind, _ in block_kinds(model) for p in module.parameters()}
        self._paused = False
        self._node_block: dict = {}

    @contextlib.contextmanager
    def within(self, phase: str):
        self.phase = phase
        try:
            yield
        finally:
            self.phase = None

    def _sequence_nr(self) -> int:
        """The next autograd sequence number (a throwaway node takes it; not counted)."""
        self._paused = True
        try:
            with torch.enable_grad():
                return torch.ones((), requires_grad=True).mul(1).grad_fn._sequence_nr()
        finally:
            self._paused = False

    def __call__(self, event: str, kind: str) -> None:
        if event == "enter":
            self.blocks.append((kind, self._sequence_nr()))
        else:
            kind, first = self.blocks.pop()
            self.spans.append((first, self._sequence_nr(), kind))

    def _block_of_node(self, node) -> str:
        if node not in self._node_block:
            variable = getattr(node, "variable", None)
            if variable is not None:  # AccumulateGrad
                block = self.param_block.get(variable, "unknown")
            else:
                seq = node._sequence_nr()
                inside = [(first, kind) for first, last, kind in self.spans if first <= seq < last]
                block = max(inside)[1] if inside else ("loss" if self.spans and seq >= self.spans[-1][1] else "unknown")
            self._node_block[node] = block
        return self._node_block[node]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._paused and func.namespace != "profiler":
            node = torch._C._current_autograd_node()
            if node is not None:
                self.counts["backward", self._block_of_node(node)] += 1
            elif self.phase == "forward":
                self.counts["forward", self.blocks[-1][0] if self.blocks else "embedding_head"] += 1
            elif self.phase == "backward":
                self.counts["backward", "engine"] += 1
            else:
                self.counts[self.phase or "loop", ""] += 1
        return func(*args, **(kwargs or {}))


def count_ops(loop, tokens: torch.Tensor) -> dict:
    """Operators of one training step of `loop` (step_breakdown.Loop) by phase and block, and per block of a kind."""
    counter = OpCounter(loop.model)
    with block_ranges(loop.model, counter), counter:
        loop.step(tokens, counter.within)
    forward = {b: n for (p, b), n in counter.counts.items() if p == "forward"}
    backward = {b: n for (p, b), n in counter.counts.items() if p == "backward"}
    instances = Counter(kind for _, kind, whole in block_kinds(loop.model) if whole)
    return {"total": sum(counter.counts.values()), "forward": forward, "backward": backward,
            **{p: sum(n for (q, _), n in counter.counts.items() if q == p)
               for p in ("loss", "optimizer", "grad_all_reduce", "loop")},
            "per_block": {b: {"blocks": instances[b], "forward": forward.get(b, 0) // max(instances[b], 1),
                              "backward": backward.get(b, 0) // max(instances[b], 1)}
                          for b in sorted(instances)}}


def decoding_ops(model, tokens: torch.Tensor, cache) -> dict[str, int]:
    """Operators of one cached decoding step of `model` (eval mode) by block kind."""
    counter = OpCounter(model)
    with block_ranges(model, counter), counter, counter.within("forward"):
        model(tokens, cache=cache)
    return {b: n for (_, b), n in counter.counts.items()}
