"""Activation memory of a model's training step, measured: what the step-time model's memory per GPU reads.

Autograd's saved tensors are counted with saved-tensor hooks on a real model with one layer of each kind,
on one GPU's share of the experts (`one_gpu.OneGPUDispatcher`), every form as the FLOP counter traces it.
"""
from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import replace

import torch
import torch.nn.functional as F

from smlp.flop_forms import counted_forms
from smlp.lm import LanguageModel, LMConfig

from .one_gpu import OneGPUDispatcher

__all__ = ["SMALL_VOCAB", "activation_bytes"]

SMALL_VOCAB = (64, 128)  # the head is measured at two small vocabularies and extended linearly


def activation_bytes(cfg: LMConfig, tokens: int, experts_per_gpu: int = 1, *,
                     exact: bool = False) -> dict[str, tuple[int, int]]:
    """Bytes autograd keeps for the backward pass of ONE sequence: {"head", "dense", "sparse"} ->
    (floating-point elements, other bytes), measured with saved-tensor hooks on a real model with one
    layer of each kind, in train mode, attention materialised (storages counted once; parameters
    and 0-dim scalars excluded). A spatial weight's n x n slice is saved once per call, so scaling
    by B overstates a gMLP block slightly (about (B - 1) / (15 B) at D = 1024, F = 4096).

    The head's saved tensors grow linearly with the vocabulary and nothing else depends on it, so
    unless `exact` the layers are measured at a small vocabulary and the head at two, extended
    linearly to cfg.vocab_size."""
    return dict(_activation_bytes(cfg, tokens, experts_per_gpu, exact))


@functools.lru_cache(maxsize=64)  # a measurement at paper scale takes seconds; configs are frozen
def _activation_bytes(cfg: LMConfig, tokens: int, experts_per_gpu: int, exact: bool) -> tuple:
    V1, V2 = SMALL_VOCAB
    if exact or cfg.vocab_size <= V2:
        return tuple(_measure(cfg, tokens, experts_per_gpu, layers=True).items())
    measured = _measure(replace(cfg, vocab_size=V1), tokens, experts_per_gpu, layers=True)
    h1 = _measure(replace(cfg, vocab_size=V1), tokens, experts_per_gpu, layers=False)["head"]
    h2 = _measure(replace(cfg, vocab_size=V2), tokens, experts_per_gpu, layers=False)["head"]
    if h1 != measured["head"]:
        raise RuntimeError(f"the head's activations depend on the layers ({h1} vs {measured['head']}): "
                           f"measure with exact=True")
    measured["head"] = tuple(a + (b - a) * (cfg.vocab_size - V1) // (V2 - V1) for a, b in zip(h1, h2))
    return tuple(measured.items())


def _measure(cfg: LMConfig, tokens: int, experts_per_gpu: int, *, layers: bool) -> dict[str, tuple[int, int]]:
    small = cfg.with_layers(1, 1 if cfg.sparse_layers else 0)
    torch.manual_seed(0)
    dispatcher = OneGPUDispatcher(cfg.num_experts, experts_per_gpu) if cfg.sparse_layers else None
    model = LanguageModel(small, dispatcher).train()
    if not layers:
        model.layers = torch.nn.ModuleList()  # embedding -> final norm -> output projection: the head alone
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    stack = ["head"]
    acc: dict[str, list[int]] = defaultdict(lambda: [0, 0])

    def pack(t):
        if isinstance(t, torch.Tensor) and t.dim() and not t.is_meta:  # 0-dim scalars: negligible
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in params and ptr not in seen:
                seen.add(ptr)
                if t.is_floating_point():
                    acc[stack[-1]][0] += storage.nbytes() // t.element_size()
                else:
                    acc[stack[-1]][1] += storage.nbytes()
        return t

    handles = []
    for layer, kind in zip(model.layers, small.plan):
        handles.append(layer.register_forward_pre_hook(lambda m, a, kind=kind: stack.append(kind)))
        handles.append(layer.register_forward_hook(lambda m, a, o: stack.pop() and None))  # None: keep the output
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(min(4, cfg.vocab_size - 1), cfg.vocab_size, (1, tokens + 1), generator=g)
    try:
        with counted_forms(model), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size).float(), ids[:, 1:].reshape(-1))
            aux = model.aux_loss()  # Switch / GShard load-balancing loss: trained too
            if aux is not None:
                loss = loss + aux
    finally:
        for h in handles:
            h.remove()
    return {k: (v[0], v[1]) for k, v in acc.items()}
