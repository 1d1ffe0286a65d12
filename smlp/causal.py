"""Causal spatial products without the zero triangle: y = tril(W) x as blocked GEMMs.

The SGU (gMLP sec. 2.1, made causal by masking its T x T weight, mixers.py), the multi-head SGU
and the sMoE's spatial experts (sMLP sec. 3.1-3.2, experts.py) multiply by a lower-triangular
weight. As a dense product half of its multiply-adds are zeros; fused causal attention skips
them, and so does this. The n positions are cut into blocks of `block` rows:

    forward  y[I]            = W[I, :end(I)] x[:end(I)]           one GEMM per row block I
    grad x   gx[J]           = W[start(J):, J]^T g[start(J):]     one GEMM per column block J
    grad W   gW[I, :end(I)]  = g[I] x[:end(I)]^T                  one GEMM per row block (and batch entry)

with W the masked tril(W): the diagonal blocks multiply their upper triangle as zeros, so a
product executes n^2 / 2 + n x block / 2 of the dense form's n^2 multiply-adds per column
(`executed_pairs`), and the gradient of the masked entries is zero, as the masked dense form
gives. Each element of y and of gx is one GEMM's sum over its whole causal prefix, accumulated as
BLAS accumulates (in fp32 for half inputs), exactly as in the dense product. Only gW sums over
independent batch entries (sequences sharing a weight); that sum runs in an fp32 buffer whatever
the input dtype (the precision rules of numerics.py: no accumulation in half precision).

Layout (`causal_product`): x_ANGK, A batch entries, n positions, G weight groups (SGU heads,
spatial experts), K columns, any strides: y[a, :, g, :] = tril(W[g, :n, :n]) x[a, :, g, :]. The
SGU passes its (B, n, H, C/H) activations as they are; the sMoE experts pass their rows
transposed (positions first: a (M, rows) view with strides (1, M)), so no operand is copied: BLAS
reads and writes transposed and strided matrices in place. The output has x's strides.

The block size was measured (benchmarks/causal_product.py): `default_block`. The FLOPs
calculator keeps the paper's convention (the full T x T product, Table 3): its counts use the
masked dense form (`explicit_spatial`); `executed_pairs` gives what this form executes.

Shapes: A batch entries, n positions (n <= T), G weight groups, K columns, T weight size.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

__all__ = ["BLOCK", "causal_product", "causal_product_rows", "default_block", "executed_pairs", "explicit_spatial",
           "masked_dense_product"]

# Rows per block, measured at the benchmark's and the paper's sizes (benchmarks/causal_product.py):
# smaller blocks skip more zeros but make more, thinner GEMMs.
BLOCK = 128


def default_block(n: int) -> int:
    """The block size for n positions (one block, the dense masked product, when n <= BLOCK)."""
    return BLOCK


def executed_pairs(n: int, block: int | None = None) -> int:
    """(output position, input position) pairs the blocked product multiplies per column: the causal
    n (n + 1) / 2 plus the upper triangles of the diagonal blocks. The dense form multiplies n^2."""
    block = default_block(n) if block is None else block
    total, start = 0, 0
    while start < n:
        end = min(start + block, n)
        total += (end - start) * end
        start = end
    return total


def masked_dense_product(w_GTT: Tensor, x_ANGK: Tensor) -> Tensor:
    """The reference: the masked dense form, tril(W[:n, :n]) as a full matrix (what fvcore counts)."""
    n = x_ANGK.shape[1]
    return torch.einsum("gts,asgk->atgk", torch.tril(w_GTT[:, :n, :n]), x_ANGK)


def causal_product(w_GTT: Tensor, x_ANGK: Tensor, block: int | None = None) -> Tensor:
    """y[a, :, g, :] = tril(w[g, :n, :n]) @ x[a, :, g, :], n = x.shape[1] <= T (module docstring).

    Under autocast the product runs in autocast's dtype, as the dense matmul would."""
    if w_GTT.dim() != 3 or x_ANGK.dim() != 4 or w_GTT.shape[0] != x_ANGK.shape[2] \
            or w_GTT.shape[1] != w_GTT.shape[2] or x_ANGK.shape[1] > w_GTT.shape[1]:
        raise ValueError(f"causal_product needs a (G, T, T) weight and (A, n <= T, G, K) rows, got "
                         f"{tuple(w_GTT.shape)} and {tuple(x_ANGK.shape)}")
    n = x_ANGK.shape[1]
    block = default_block(n) if block is None else block
    if block < 1:
        raise ValueError(f"block={block} is invalid: it must be a positive number of positions")
    device_type = x_ANGK.device.type
    if _autocast_on(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type=device_type, enabled=False):
            return _CausalProduct.apply(w_GTT.to(dtype), x_ANGK.to(dtype), block)
    if w_GTT.dtype != x_ANGK.dtype:
        raise ValueError(f"causal_product: weight dtype {w_GTT.dtype} and input dtype {x_ANGK.dtype} differ")
    return _CausalProduct.apply(w_GTT, x_ANGK, block)


def causal_product_rows(w_LTT: Tensor, x_RM: Tensor, counts_L: list[int], block: int | None = None) -> Tensor:
    """The sMoE experts' layout: rows of M positions grouped by expert, counts_L[l] rows for weight
    l; y[rows of l] = x[rows of l] @ tril(w[l, :M, :M])^T. Equal counts are one `causal_product`
    over the experts; unequal counts one product per expert inside one autograd node (one masked
    weight stack and one fp32 gradient buffer for all of them)."""
    L, (R, M) = len(counts_L), x_RM.shape
    if w_LTT.dim() != 3 or w_LTT.shape[0] != L or M > w_LTT.shape[1] or sum(counts_L) != R:
        raise ValueError(f"causal_product_rows needs (L, T, T) weights, (R, M <= T) rows and L counts adding up to "
                         f"R, got {tuple(w_LTT.shape)}, {tuple(x_RM.shape)} and {counts_L}")
    if counts_L and all(c == counts_L[0] for c in counts_L):
        c = counts_L[0]
        y_1MLc = causal_product(w_LTT, x_RM.reshape(L, c, M).permute(2, 0, 1)[None], block)
        return y_1MLc[0].permute(1, 2, 0).reshape(R, M)
    block = default_block(M) if block is None else block
    device_type = x_RM.device.type
    if _autocast_on(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type=device_type, enabled=False):
            return _CausalRows.apply(w_LTT.to(dtype), x_RM.to(dtype), list(counts_L), block)
    return _CausalRows.apply(w_LTT, x_RM, list(counts_L), block)


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError):  # a device type without autocast (meta)
        return False


def _blocks(n: int, block: int):
    for start in range(0, n, block):
        yield start, min(start + block, n)


class _CausalProduct(torch.autograd.Function):
    """Forward and backward of `causal_product` as blocked GEMMs (module docstring). Each block is
    one batched GEMM over the weight groups (one weight, several batch entries: over the entries)."""

    @staticmethod
    def forward(ctx, w_GTT: Tensor, x_ANGK: Tensor, block: int) -> Tensor:
        A, n, G, K = x_ANGK.shape
        w_GNN = torch.tril(w_GTT[:, :n, :n])  # masked once: diagonal blocks read zeros above it
        y_ANGK = torch.empty_like(x_ANGK)
        for start, end in _blocks(n, block):
            _bmm_over(w_GNN[:, start:end, :end], x_ANGK[:, :end], y_ANGK[:, start:end])
        ctx.save_for_backward(w_GNN, x_ANGK)
        ctx.block, ctx.T = block, w_GTT.shape[-1]
        return y_ANGK

    @staticmethod
    def backward(ctx, g_ANGK: Tensor):
        w_GNN, x_ANGK = ctx.saved_tensors
        A, n, G, K = x_ANGK.shape
        grad_w = grad_x = None
        if ctx.needs_input_grad[1]:
            grad_x = torch.empty_like(x_ANGK)
            for start, end in _blocks(n, ctx.block):  # column block J: every later row reads it
                _bmm_over(w_GNN[:, start:, start:end].transpose(1, 2), g_ANGK[:, start:], grad_x[:, start:end])
        if ctx.needs_input_grad[0]:
            acc_dtype = torch.promote_types(x_ANGK.dtype, torch.float32)  # fp32, or fp64 for fp64
            acc_GNN = torch.zeros(G, n, n, dtype=acc_dtype, device=x_ANGK.device)
            in_place = x_ANGK.dtype == acc_dtype  # accumulate over the batch inside the GEMM
            for start, end in _blocks(n, ctx.block):
                acc_GIP = acc_GNN[:, start:end, :end]
                for a in range(A):
                    g_GIK, xt_GKP = g_ANGK[a, start:end].transpose(0, 1), x_ANGK[a, :end].permute(1, 2, 0)
                    if in_place:
                        acc_GIP.baddbmm_(g_GIK, xt_GKP)
                    else:
                        acc_GIP.add_(torch.bmm(g_GIK, xt_GKP))
            acc_GNN.tril_()  # the masked entries (diagonal blocks' upper triangles) get no gradient
            grad_w = acc_GNN.new_zeros(G, ctx.T, ctx.T) if n < ctx.T else acc_GNN
            if n < ctx.T:
                grad_w[:, :n, :n] = acc_GNN
            grad_w = grad_w.to(w_GNN.dtype)
        return grad_w, grad_x, None


class _CausalRows(torch.autograd.Function):
    """`causal_product_rows` with unequal counts: per expert, the blocked GEMMs of `_CausalProduct`
    on the transposed rows (positions first, read in place)."""

    @staticmethod
    def forward(ctx, w_LTT: Tensor, x_RM: Tensor, counts_L: list[int], block: int) -> Tensor:
        M = x_RM.shape[1]
        w_LMM = torch.tril(w_LTT[:, :M, :M])
        y_RM = torch.empty_like(x_RM)
        for l, (r0, r1) in _row_ranges(counts_L):
            xt_MC, yt_MC = x_RM[r0:r1].t(), y_RM[r0:r1].t()
            for start, end in _blocks(M, block):
                torch.mm(w_LMM[l, start:end, :end], xt_MC[:end], out=yt_MC[start:end])
        ctx.save_for_backward(w_LMM, x_RM)
        ctx.counts, ctx.block, ctx.T = counts_L, block, w_LTT.shape[-1]
        return y_RM

    @staticmethod
    def backward(ctx, g_RM: Tensor):
        w_LMM, x_RM = ctx.saved_tensors
        L, M = w_LMM.shape[0], x_RM.shape[1]
        grad_w = grad_x = None
        if ctx.needs_input_grad[1]:
            grad_x = torch.empty_like(x_RM)
            for l, (r0, r1) in _row_ranges(ctx.counts):
                gt_MC, gxt_MC = g_RM[r0:r1].t(), grad_x[r0:r1].t()
                for start, end in _blocks(M, ctx.block):
                    torch.mm(w_LMM[l, start:, start:end].t(), gt_MC[start:], out=gxt_MC[start:end])
        if ctx.needs_input_grad[0]:
            acc_dtype = torch.promote_types(x_RM.dtype, torch.float32)
            acc_LMM = torch.zeros(L, M, M, dtype=acc_dtype, device=x_RM.device)
            for l, (r0, r1) in _row_ranges(ctx.counts):
                gt_MC = g_RM[r0:r1].t()
                for start, end in _blocks(M, ctx.block):  # each block written once: no sum in half precision
                    if x_RM.dtype == acc_dtype:
                        torch.mm(gt_MC[start:end], x_RM[r0:r1, :end], out=acc_LMM[l, start:end, :end])
                    else:
                        acc_LMM[l, start:end, :end] = torch.mm(gt_MC[start:end], x_RM[r0:r1, :end])
            acc_LMM.tril_()
            grad_w = acc_LMM.new_zeros(L, ctx.T, ctx.T) if M < ctx.T else acc_LMM
            if M < ctx.T:
                grad_w[:, :M, :M] = acc_LMM
            grad_w = grad_w.to(w_LMM.dtype)
        return grad_w, grad_x, None, None


def _row_ranges(counts_L: list[int]):
    start = 0
    for l, c in enumerate(counts_L):
        if c:
            yield l, (start, start + c)
        start += c


def _bmm_over(w_GIP: Tensor, x_APGK: Tensor, out_AIGK: Tensor) -> None:
    """out[a, :, g] = w[g] @ x[a, :, g] for every a and g, written in place: one batched GEMM over the
    groups per batch entry, or over the batch entries (the weight expanded, not copied) for one group."""
    A, G = x_APGK.shape[0], x_APGK.shape[2]
    if G == 1 and A > 1:
        torch.bmm(w_GIP[0].expand(A, *w_GIP.shape[1:]), x_APGK[:, :, 0], out=out_AIGK[:, :, 0])
        return
    for a in range(A):
        torch.bmm(w_GIP, x_APGK[a].transpose(0, 1), out=out_AIGK[a].transpose(0, 1))


# ---------------------------------------------------------------- FLOP counting


@contextlib.contextmanager
def explicit_spatial(module: nn.Module):
    """Within the block, every spatial product in `module` runs as the masked dense product, which
    fvcore can trace and counts as the paper does (full T x T, Table 3); the blocked form is one
    Python autograd Function to a tracer."""
    mods = [m for m in module.modules() if hasattr(m, "explicit_spatial")]
    before = [m.explicit_spatial for m in mods]
    for m in mods:
        m.explicit_spatial = True
    try:
        yield module
    finally:
        for m, b in zip(mods, before):
            m.explicit_spatial = b
