"""Activation checkpointing (fairseq's --checkpoint-activations): a stage's activations recomputed in backward.

A recomputed stage runs under torch.utils.checkpoint (non-reentrant): autograd keeps the stage's inputs, not
what it computes inside, and runs the stage again when backward reaches it, with the same random numbers
(dropout draws the same masks) and the same autocast state. `LanguageModel(cfg)` with
`cfg.checkpoint_activations` sets `recompute` on every module that has it:

    dense blocks (gMLP, HyperMixer, NiNformer, Transformer)  the whole block, from its input
    Transformer block with a tMoE                           attention and the norm before the router
    tMoE (sMLP sparse block, Transformer-MoE)               the FFN experts, between dispatch and combine
    token-routed gMLP block                                  its experts, after the routing

Routing and the exchanges are never recomputed: no collective runs twice, a balanced router's auction and its
price record happen once, and backward reads nothing more from the device. A sparse layer keeps what crosses
its exchanges (the rows its experts received, the results brought back) and its routing plan. The sMoE's
spatial experts are linear in the rows they receive, which they keep anyway: nothing to gain there.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["recomputed"]


def recomputed(enabled: bool, fn: Callable, *args):
    """fn(*args), its activations recomputed in backward when `enabled` and autograd records (training);
    otherwise the plain call. `fn` must run no collective and change no state that outlives it."""
    if not enabled or not torch.is_grad_enabled() or torch.jit.is_tracing():  # tracing: the FLOP counter
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False)
