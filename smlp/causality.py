"""The causality check (sMLP Appendix B): changing the input after position t must leave every output
at positions <= t bit-identical.

`first_checked` lets partial prediction skip its routing prefix, whose positions are not predicted;
`randomized` moves a model's weights far from their near-identity init, so that a leak cannot hide
behind a zero weight.
"""
from __future__ import annotations

import torch


def earlier_outputs_unchanged(fn, x, t: int, *, first_checked: int = 0, seed: int = 0, future=None) -> bool:
    """True when fn(x) and fn(x with positions > t replaced) agree exactly at positions first_checked..t.

    x is (batch, length, ...) floats or (batch, length) token ids. The RNG is reset before each
    call so dropout masks (same shapes) are identical.
    """
    x2 = x.clone()
    if future is None:
        g = torch.Generator().manual_seed(seed + 1)
        if x.dtype.is_floating_point:
            future = torch.randn(x[:, t + 1:].shape, generator=g, dtype=x.dtype) * 3
        else:
            future = torch.randint(int(x.min()), int(x.max()) + 1, x[:, t + 1:].shape, generator=g)
    x2[:, t + 1:] = future
    assert not torch.equal(x, x2), "the perturbation must change the input"
    torch.manual_seed(seed)
    y1 = fn(x)
    torch.manual_seed(seed)
    y2 = fn(x2)
    return torch.equal(y1[:, first_checked:t + 1], y2[:, first_checked:t + 1])


def assert_causal(fn, x, *, first_checked: int = 0, positions=None, seed: int = 0) -> None:
    n = x.shape[1]
    positions = positions if positions is not None else sorted({first_checked, (first_checked + n) // 2, n - 2})
    for t in positions:
        assert earlier_outputs_unchanged(fn, x, t, first_checked=first_checked, seed=seed), (
            f"outputs at positions {first_checked}..{t} changed when positions > {t} changed"
        )


def randomized(model: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    """Weights far from their near-identity init, so that every path carries signal (LayerNorms kept
    at their init: a random LayerNorm bias would give every token the same router logits)."""
    g = torch.Generator().manual_seed(seed)
    norms = {id(p) for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in norms:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model
