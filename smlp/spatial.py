"""The causal spatial weights: their helpers, and their products without the zero triangle.

The SGU (gMLP sec. 2.1, gmlp.py), the multi-head SGU, the sMoE's spatial experts (sMLP sec. 3.1-3.2,
experts.py) and NiNformer's token MLP mix positions with weights tied to absolute positions. Here are
their length check, causal corner and near-identity init, and y = tril(W) x as blocked GEMMs that
skip the zero triangle, as fused causal attention does:

    forward  y[I]            = W[I, :end(I)] x[:end(I)]           one GEMM per row block I
    grad x   gx[J]           = W[start(J):, J]^T g[start(J):]     one GEMM per column block J
    grad W   gW[I, :end(I)]  = g[I] x[:end(I)]^T                  one GEMM per row block (and batch entry)

Each element of y and gx is one GEMM's sum over its causal prefix, as in the dense product; gW's sum
over batch entries runs in an fp32 buffer (precision.py). Operands are read in place with any strides
(the sMoE passes its rows transposed), so nothing is copied. The FLOP counter keeps the paper's full
T x T product (flop_forms.explicit_spatial); `executed_pairs` counts what this form executes.
Shapes: the core's legend (smlp/__init__.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .precision import accumulation_dtype, autocast_enabled

__all__ = ["BLOCK", "causal_product", "causal_product_rows", "causal_step", "causal_weight", "check_length",
           "default_block", "executed_pairs", "init_spatial_", "masked_dense_product", "uniform_per_slice_"]


def check_length(n: int, max_len: int, what: str = "sequence") -> None:
    if n > max_len:
        raise ValueError(
            f"{what} length {n} exceeds the spatial weight's size {max_len}: the model was built for at "
            f"most {max_len} positions; use shorter sequences (e.g. --tokens-per-sample {max_len}) or build "
            f"the model with a longer seq_len"
        )


def causal_step(weight_GTT: Tensor, bias_offset_GT: Tensor, x_BtC: Tensor, start: int) -> Tensor:
    """Cached decoding of a causal spatial product with G weight groups (heads, or the sMoE's experts
    under deterministic routing, group g mixing channel chunk g).

    Returns W x + (b - 1) at positions start..t-1 from all t positions of x_BtC, (B, k, C): O(t) per
    position. `bias_offset_GT` holds b - 1. One sequence's chunks are read from the cache in place."""
    B, t, C = x_BtC.shape
    G = weight_GTT.shape[0]
    w_GkT = weight_GTT[:, start:t, :t]
    if t - start > 1:
        w_GkT = torch.tril(w_GkT, diagonal=start)
    if G == 1:  # a plain matmul: einsum's planning costs more than the product at one position
        return torch.matmul(w_GkT[0], x_BtC) + bias_offset_GT[0, start:t, None]
    if B == 1:  # (G, k, t) x (G, t, c): the chunks as strided matrices of the cache, one batched product
        y_Gkc = torch.matmul(w_GkT, x_BtC[0].reshape(t, G, C // G).transpose(0, 1)) + bias_offset_GT[:, start:t, None]
        return y_Gkc.transpose(0, 1).reshape(1, t - start, C)
    y_BkGc = torch.einsum("hts,bshc->bthc", w_GkT, x_BtC.reshape(B, t, G, C // G))
    y_BkGc = y_BkGc + bias_offset_GT[:, start:t].t()[None, :, :, None]
    return y_BkGc.reshape(B, t - start, C)


def causal_weight(weight_GTT: Tensor, n: int) -> Tensor:
    """The lower-triangular n x n corner of one or more T x T spatial weights."""
    return torch.tril(weight_GTT[..., :n, :n])


@torch.no_grad()
def uniform_per_slice_(param: Tensor, bound: float, generators: list[torch.Generator]) -> None:
    """param[l] ~ U(-bound, bound) drawn from generators[l] (on the CPU, then copied to param's device).

    An expert's initial weights must not depend on how the experts are spread over ranks
    (experts.py). Meta tensors are left as they are.
    """
    if param.is_meta:
        return
    for l, g in enumerate(generators):
        param[l].copy_(torch.empty(param.shape[1:], device="cpu").uniform_(-bound, bound, generator=g))


@torch.no_grad()
def init_spatial_(weight: Tensor, bias_offset: Tensor, init_eps: float,
                  generators: list[torch.Generator] | None = None) -> None:
    """Near-identity init (gMLP 2.1): weight ~ U(-eps/T, eps/T), bias b = 1, stored as its offset b - 1 = 0
    (`load_gate_bias_offset`).

    With `generators`, slice l of the weight (one expert) is drawn from generators[l].
    """
    bound = init_eps / weight.shape[-1]
    if generators is None:
        weight.uniform_(-bound, bound)
    else:
        uniform_per_slice_(weight, bound, generators)
    bias_offset.zero_()


def load_gate_bias_offset(state_dict: dict, prefix: str) -> None:
    """Convert a state holding a spatial gate's bias as `bias` = b into `bias_offset` = b - 1, in place.

    The offset is kept because in bf16 a bias near 1 has a resolution of only 2^-7; b - 1 is exact for
    b in [0.5, 2]. The modules' `_load_from_state_dict` call this, so every loading path reads both."""
    old, new = prefix + "bias", prefix + "bias_offset"
    if old in state_dict and new not in state_dict:
        state_dict[new] = state_dict.pop(old) - 1


# ---------------------------------------------------------------- causal products

# Rows per block, measured at the benchmark's and the paper's sizes (docs/benchmarks.md, commit 60aed7a):
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


def masked_dense_product(w_GTT: Tensor, x_ANGc: Tensor) -> Tensor:
    """The reference: the masked dense form, tril(W[:n, :n]) as a full matrix (what fvcore counts)."""
    n = x_ANGc.shape[1]
    return torch.einsum("gts,asgc->atgc", torch.tril(w_GTT[:, :n, :n]), x_ANGc)


def causal_product(w_GTT: Tensor, x_ANGc: Tensor, block: int | None = None) -> Tensor:
    """y[a, :, g, :] = tril(w[g, :n, :n]) @ x[a, :, g, :], n = x.shape[1] <= T, as blocked GEMMs.

    Under autocast the product runs in autocast's dtype, as the dense matmul would."""
    if w_GTT.dim() != 3 or x_ANGc.dim() != 4 or w_GTT.shape[0] != x_ANGc.shape[2] \
            or w_GTT.shape[1] != w_GTT.shape[2] or x_ANGc.shape[1] > w_GTT.shape[1]:
        raise ValueError(f"causal_product needs a (G, T, T) weight and (A, n <= T, G, K) rows (K columns per weight "
                         f"group), got {tuple(w_GTT.shape)} and {tuple(x_ANGc.shape)}")
    n = x_ANGc.shape[1]
    block = default_block(n) if block is None else block
    if block < 1:
        raise ValueError(f"block={block} is invalid: it must be a positive number of positions")
    device_type = x_ANGc.device.type
    if autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type=device_type, enabled=False):
            return _CausalProduct.apply(w_GTT.to(dtype), x_ANGc.to(dtype), block)
    if w_GTT.dtype != x_ANGc.dtype:
        raise ValueError(f"causal_product: weight dtype {w_GTT.dtype} and input dtype {x_ANGc.dtype} differ")
    return _CausalProduct.apply(w_GTT, x_ANGc, block)


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
        # squeeze, not [0]: a select's backward would write the gradient into a zero-filled copy
        return y_1MLc.squeeze(0).permute(1, 2, 0).reshape(R, M)
    block = default_block(M) if block is None else block
    device_type = x_RM.device.type
    if autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type=device_type, enabled=False):
            return _CausalRows.apply(w_LTT.to(dtype), x_RM.to(dtype), list(counts_L), block)
    return _CausalRows.apply(w_LTT, x_RM, list(counts_L), block)


def _blocks(n: int, block: int):
    for start in range(0, n, block):
        yield start, min(start + block, n)


class _CausalProduct(torch.autograd.Function):
    """Forward and backward of `causal_product`: each block one batched GEMM over the weight groups
    (over the batch entries when there is one group)."""

    @staticmethod
    def forward(ctx, w_GTT: Tensor, x_ANGc: Tensor, block: int) -> Tensor:
        A, n, G, c = x_ANGc.shape
        w_GNN = torch.tril(w_GTT[:, :n, :n])  # masked once: diagonal blocks read zeros above it
        y_ANGc = torch.empty_like(x_ANGc)
        for start, end in _blocks(n, block):
            _bmm_over(w_GNN[:, start:end, :end], x_ANGc[:, :end], y_ANGc[:, start:end])
        ctx.save_for_backward(w_GNN, x_ANGc)
        ctx.block, ctx.T = block, w_GTT.shape[-1]
        return y_ANGc

    @staticmethod
    def backward(ctx, g_ANGc: Tensor):
        w_GNN, x_ANGc = ctx.saved_tensors
        A, n, G, c = x_ANGc.shape
        grad_w = grad_x = None
        if ctx.needs_input_grad[1]:
            grad_x = torch.empty_like(x_ANGc)
            for start, end in _blocks(n, ctx.block):  # column block J: every later row reads it
                _bmm_over(w_GNN[:, start:, start:end].transpose(1, 2), g_ANGc[:, start:], grad_x[:, start:end])
        if ctx.needs_input_grad[0]:
            acc_dtype = accumulation_dtype(x_ANGc.dtype)  # fp32, or fp64 for fp64
            acc_GNN = torch.zeros(G, n, n, dtype=acc_dtype, device=x_ANGc.device)
            in_place = x_ANGc.dtype == acc_dtype  # accumulate over the batch inside the GEMM
            for start, end in _blocks(n, ctx.block):
                acc_GIJ = acc_GNN[:, start:end, :end]
                for a in range(A):
                    g_GIc, xt_GcJ = g_ANGc[a, start:end].transpose(0, 1), x_ANGc[a, :end].permute(1, 2, 0)
                    if in_place:
                        acc_GIJ.baddbmm_(g_GIc, xt_GcJ)
                    else:
                        acc_GIJ.add_(torch.bmm(g_GIc, xt_GcJ))
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
            xt_Mc, yt_Mc = x_RM[r0:r1].t(), y_RM[r0:r1].t()
            for start, end in _blocks(M, block):
                torch.mm(w_LMM[l, start:end, :end], xt_Mc[:end], out=yt_Mc[start:end])
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
                gt_Mc, gxt_Mc = g_RM[r0:r1].t(), grad_x[r0:r1].t()
                for start, end in _blocks(M, ctx.block):
                    torch.mm(w_LMM[l, start:, start:end].t(), gt_Mc[start:], out=gxt_Mc[start:end])
        if ctx.needs_input_grad[0]:
            acc_dtype = accumulation_dtype(x_RM.dtype)
            acc_LMM = torch.zeros(L, M, M, dtype=acc_dtype, device=x_RM.device)
            for l, (r0, r1) in _row_ranges(ctx.counts):
                gt_Mc = g_RM[r0:r1].t()
                for start, end in _blocks(M, ctx.block):  # each block written once: no sum in half precision
                    if x_RM.dtype == acc_dtype:
                        torch.mm(gt_Mc[start:end], x_RM[r0:r1, :end], out=acc_LMM[l, start:end, :end])
                    else:
                        acc_LMM[l, start:end, :end] = torch.mm(gt_Mc[start:end], x_RM[r0:r1, :end])
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


def _bmm_over(w_GIJ: Tensor, x_AJGc: Tensor, out_AIGc: Tensor) -> None:
    """out[a, :, g] = w[g] @ x[a, :, g] for every a and g, written in place: one batched GEMM over the
    groups per batch entry, or over the batch entries (the weight expanded, not copied) for one group."""
    A, G = x_AJGc.shape[0], x_AJGc.shape[2]
    if G == 1 and A > 1:
        torch.bmm(w_GIJ[0].expand(A, *w_GIJ.shape[1:]), x_AJGc[:, :, 0], out=out_AIGc[:, :, 0])
        return
    for a in range(A):
        torch.bmm(w_GIJ, x_AJGc[a].transpose(0, 1), out=out_AIGc[a].transpose(0, 1))
