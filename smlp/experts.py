"""Experts: the parameters that live on one rank only.

Shapes: the core's legend (smlp/__init__.py); here R rows received (grouped by local expert), c rows of
one expert when all hold as many, M row length of an sMoE row (positions), k positions of a decoding step.

Expert e gets the same initial weights whatever the world size (one draw of the global RNG, then a
generator per expert), so a seeded W-rank run starts from the model a seeded single-process run starts
from. Every expert parameter carries `param.expert = True`: fairseq's legacy_ddp skips it in the gradient
all-reduce. Several experts on one rank run as one product where they can (a batched matmul for equal
counts, torch's grouped matmul for unequal counts on accelerators, one blocked causal product for the
spatial experts); where they loop, the stacked weights are unbound once, because indexing them expert by
expert makes every expert's gradient a zero-filled copy of the whole stack.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .spatial import (
    causal_product_rows,
    causal_step,
    causal_weight,
    check_length,
    init_spatial_,
    load_gate_bias_offset,
    uniform_per_slice_,
)

__all__ = ["mark_expert", "is_expert", "FFNExperts", "SpatialExperts"]


def mark_expert(module: nn.Module) -> nn.Module:
    """Mark every parameter of `module` as an expert parameter (`is_expert`): it lives on one rank only."""
    for p in module.parameters():
        p.expert = True
    return module


def is_expert(param) -> bool:
    """Whether `param` is an expert parameter (`mark_expert`): held by one rank, left out of the data-parallel
    all-reduce, resharded by expert, optimized locally (the one test every layer and plugin uses)."""
    return bool(getattr(param, "expert", False))


def _expert_generators(num_local_experts: int, first_expert: int) -> list[torch.Generator]:
    """One CPU generator per local expert, seeded from one draw of the global RNG plus the expert's
    global index."""
    base = int(torch.randint(0, 2 ** 62, (1,), device="cpu"))  # the CPU RNG even under a default-device context
    return [torch.Generator().manual_seed(base + first_expert + l) for l in range(num_local_experts)]


def _check_counts(x_RD: Tensor, counts_L: list[int]) -> None:
    if sum(counts_L) != x_RD.shape[0]:
        raise ValueError(f"expert counts {counts_L} do not add up to the {x_RD.shape[0]} rows received")


def _split_rows(x_RD: Tensor, counts_L: list[int]) -> list[Tensor]:
    _check_counts(x_RD, counts_L)
    return list(torch.split(x_RD, counts_L, dim=0))


def _equal_count(counts_L: list[int]) -> int | None:
    """The common count when every local expert got the same number of rows, else None."""
    return counts_L[0] if counts_L and all(c == counts_L[0] for c in counts_L) else None


class _DenseGrad(torch.autograd.Function):
    """The identity, whose backward hands on a dense gradient: grouped_mm's backward refuses the
    stride-0 gradient of, e.g., a sum."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


_GROUPED_MM: dict = {}


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped matmul (F.grouped_mm) runs forward and backward for this device and
    dtype (CPU: fp32, bf16, fp16; CUDA: bf16 on recent GPUs); probed once with a tiny product."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM:
        try:
            x = torch.ones(3, 16, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
            offs = torch.arange(1, 4, 2, dtype=torch.int32, device=device)  # [1, 3], made on the device
            F.grouped_mm(x, w, offs=offs).square().sum().backward()
            _GROUPED_MM[key] = bool(torch.equal(w.grad[1], 2 * 2 * 16 * torch.ones_like(w.grad[1])))
        except (RuntimeError, AttributeError, NotImplementedError, TypeError):
            _GROUPED_MM[key] = False
    return _GROUPED_MM[key]


def _strides_aligned(dtype: torch.dtype, *widths: int) -> bool:
    """grouped_mm needs every row stride a multiple of 16 bytes ("strides should be multiple of 16
    bytes" otherwise, on CUDA as on the CPU): D and F in elements of `dtype`."""
    return all(w * dtype.itemsize % 16 == 0 for w in widths)


def _grouped_by_default(device: torch.device) -> bool:
    """Unequal counts take the grouped product on accelerators; on the CPU it is no faster than the loop."""
    return device.type != "cpu"


def _grouped_matmul(x_RD: Tensor, w_LDF: Tensor, offs_L: Tensor) -> Tensor:
    return _DenseGrad.apply(F.grouped_mm(x_RD, w_LDF, offs=offs_L))


# ---------------------------------------------------------------- rows in fixed-shape tiles

TILE_ROWS = 16  # a multiple of the CPU GEMM kernels' row blocks; padding at most L (TILE_ROWS - 1) rows


def tile_slots(expert_S: Tensor, num_experts: int, rows: int = TILE_ROWS) -> tuple[Tensor, list[int]]:
    """Where each row goes when the rows are sorted by expert and each expert's rows padded to tiles.

    Returns (slot_S, tiles_E): row s sits at slot slot_S[s] of a (sum(tiles_E) * rows)-row buffer,
    expert e's tiles are the tiles_E[e] after those of experts < e, rows in their original order.
    tiles_E is read on the host (the number of tiles sets the products' batch sizes): one read.
    """
    S = expert_S.shape[0]
    counts_E = torch.bincount(expert_S, minlength=num_experts)
    tiles_E = (counts_E + rows - 1) // rows
    order_S = torch.argsort(expert_S, stable=True)
    sorted_expert_S = expert_S[order_S]
    first_row_E = torch.cumsum(counts_E, 0) - counts_E
    first_slot_E = (torch.cumsum(tiles_E, 0) - tiles_E) * rows
    rank_S = torch.arange(S, device=expert_S.device) - first_row_E[sorted_expert_S]
    slot_S = torch.empty_like(expert_S)
    slot_S[order_S] = first_slot_E[sorted_expert_S] + rank_S
    return slot_S, tiles_E.tolist()


def pad_to_tiles(chunks_L: list[Tensor], rows: int = TILE_ROWS) -> tuple[Tensor, list[int]]:
    """Rows already grouped by expert (chunks_L[l] of expert l) as whole tiles: each chunk followed
    by zero rows up to a multiple of `rows`, in one concatenation (no index built on the host).

    Returns (x_RD, tiles_L): the padded rows and the tiles of each expert."""
    zeros = chunks_L[0].new_zeros((rows - 1,) + tuple(chunks_L[0].shape[1:]))
    parts, tiles_L = [], []
    for chunk in chunks_L:
        pad = -chunk.shape[0] % rows
        parts += [chunk, zeros[:pad]] if pad else [chunk]
        tiles_L.append((chunk.shape[0] + pad) // rows)
    return torch.cat(parts), tiles_L


def unpad_tiles(y_RD: Tensor, counts_L: list[int], tiles_L: list[int], rows: int = TILE_ROWS) -> Tensor:
    """The rows of `pad_to_tiles`'s output that hold data (counts_L[l] of expert l), in order."""
    parts, first = [], 0
    for c, k in zip(counts_L, tiles_L):
        parts.append(y_RD[first:first + c])
        first += k * rows
    return torch.cat(parts)


class _TiledExpertLinear(torch.autograd.Function):
    """y[tile] = x[tile] @ W_e + b_e for expert e's tiles, as one fixed-shape product per tile.

    Forward: a batched (k, rows, D) @ (D, F) product per expert with k tiles (the weight broadcast,
    not copied): the product of a row does not depend on how many rows share its expert.
    Backward: the weight gradient as one (D x k rows) @ (k rows x F) product per expert (the
    broadcast's own backward would materialize k copies of it), zeros for an expert without tiles,
    so every expert's parameters take part in every backward."""

    @staticmethod
    def forward(ctx, x_RD: Tensor, tiles_E: list[int], rows: int, *params: Tensor) -> Tensor:
        E = len(tiles_E)
        weights, biases = params[:E], params[E:]
        D, Fo = x_RD.shape[1], weights[0].shape[1]
        out = []
        first = 0
        for e, k in enumerate(tiles_E):
            if k:
                x_tiles = x_RD[first * rows:(first + k) * rows].view(k, rows, D)
                y_tiles = torch.bmm(x_tiles, weights[e].expand(k, D, Fo)) + biases[e]
                out.append(y_tiles.reshape(k * rows, Fo))
            first += k
        ctx.save_for_backward(x_RD, *weights)
        ctx.tiles_E, ctx.rows = tiles_E, rows
        return torch.cat(out) if out else x_RD.new_zeros(0, Fo)

    @staticmethod
    def backward(ctx, grad_RF: Tensor):
        x_RD, *weights = ctx.saved_tensors
        rows = ctx.rows
        grad_x = x_RD.new_empty(x_RD.shape) if ctx.needs_input_grad[0] else None
        grad_w, grad_b = [], []
        first = 0
        for e, k in enumerate(ctx.tiles_E):
            sl = slice(first * rows, (first + k) * rows)
            g_RF, x_RD_e = grad_RF[sl], x_RD[sl]
            if grad_x is not None:
                grad_x[sl] = g_RF @ weights[e].t()
            grad_w.append(x_RD_e.t() @ g_RF)  # (D, F); zeros for k = 0
            grad_b.append(g_RF.sum(0))
            first += k
        return (grad_x, None, None, *grad_w, *grad_b)


def tiled_expert_linear(x_RD: Tensor, tiles_E: list[int], weights_E: list[Tensor], biases_E: list[Tensor],
                        rows: int = TILE_ROWS) -> Tensor:
    """x @ weights_E[e] + biases_E[e] for the tiles_E[e] tiles of `rows` rows of expert e (rows sorted
    by expert and padded to whole tiles: `pad_to_tiles`, `tile_slots`); weights (D, F) each."""
    return _TiledExpertLinear.apply(x_RD, tiles_E, rows, *weights_E, *biases_E)


# ---------------------------------------------------------------- the experts


def _expert_layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """An expert's own affine LayerNorm of its rows (Base Layers' expert sublayer); x as is without one.
    weight and bias broadcast against x: (D,) for one expert's rows, (R, D) per row, (L, 1, D) per batch."""
    if weight is None:
        return x
    if weight.dim() == 1:  # one expert: the fused affine form (and the form the FLOP counter counts)
        return F.layer_norm(x, x.shape[-1:], weight, bias)
    return F.layer_norm(x, x.shape[-1:]) * weight + bias


class FFNExperts(nn.Module):
    """L feed-forward experts D -> F -> D, optionally with their own input LayerNorm (Base Layers).

    zero_output: the second projection's weight starts at zero (fairseq's `BaseSublayer`), so each
    expert starts as a constant (its bias) and the layer close to the identity.

    Weights are stacked with the local-expert index first, so moving experts between world sizes is
    slicing and concatenating along dim 0. Forms of the computation: `forward_loop` (one product per
    expert: the reference, and the CPU's form for unequal counts), `_batched` (equal counts: one
    batched product), `_grouped` (unequal counts on accelerators: torch's grouped matmul) and
    `forward_tiled` (evaluation: fixed-shape tiles, so a row's result does not depend on the others).
    """

    def __init__(self, num_local_experts: int, d_model: int, d_ffn: int, *, activation: str = "gelu",
                 norm: bool = False, zero_output: bool = False, first_expert: int = 0):
        super().__init__()
        L, D, Fw = num_local_experts, d_model, d_ffn
        self.activation = F.gelu if activation == "gelu" else F.relu
        self.w1 = nn.Parameter(torch.empty(L, D, Fw))
        self.b1 = nn.Parameter(torch.empty(L, Fw))
        self.w2 = nn.Parameter(torch.empty(L, Fw, D))
        self.b2 = nn.Parameter(torch.empty(L, D))
        gens = _expert_generators(L, first_expert)
        for param, bound in ((self.w1, D ** -0.5), (self.b1, D ** -0.5), (self.w2, Fw ** -0.5), (self.b2, Fw ** -0.5)):
            uniform_per_slice_(param, bound, gens)
        if zero_output:
            with torch.no_grad():
                self.w2.zero_()
        if norm:
            self.norm_weight = nn.Parameter(torch.ones(L, D))
            self.norm_bias = nn.Parameter(torch.zeros(L, D))
        else:
            self.norm_weight = self.norm_bias = None
        mark_expert(self)
        # unequal counts through torch's grouped matmul: None = on accelerators only (on the CPU it is no
        # faster than the loop: docs/benchmarks.md); True / False force it
        self.grouped: bool | None = None
        self.explicit_experts = False  # the loop, for FLOP counting (flop_forms.py)
        self._unbound: tuple | None = None  # (key, each expert's weights): `expert_rows` without a grad

    def forward(self, x_RD: Tensor, counts_L: list[int], *, counts_dev_L: Tensor | None = None,
                fixed_counts: bool = False) -> Tensor:
        """The experts on the rows they received, grouped by local expert (counts_L[l] rows of expert l).

        Args:
            x_RD:         (R, D) the rows
            counts_L:     rows per local expert (host ints)
            counts_dev_L: (L,) the same counts on the rows' device, where the dispatcher has them: the
                          grouped product's offsets without a host-to-device copy
            fixed_counts: the counts do not depend on the rows' values (a balanced assignment). At
                          evaluation, unless they are, the rows are computed in tiles (`forward_tiled`)

        Returns:
            y_RD: (R, D)
        """
        _check_counts(x_RD, counts_L)
        L, R, D = len(counts_L), x_RD.shape[0], x_RD.shape[-1]
        c = _equal_count(counts_L)
        if self.explicit_experts:
            return self.forward_loop(x_RD, counts_L)
        if not self.training and not fixed_counts:  # a row's result must not depend on the other rows
            return self.forward_tiled(x_RD, counts_L)
        if c is not None:  # balanced (or one expert): one batched product, the weights used whole
            return self._batched(x_RD.reshape(L, c, D)).reshape(R, D)
        grouped = self.grouped if self.grouped is not None else _grouped_by_default(x_RD.device)
        if grouped and _strides_aligned(x_RD.dtype, D, self.w1.shape[-1]) \
                and grouped_mm_supported(x_RD.device, x_RD.dtype):  # unequal counts: one grouped product
            return self._grouped(x_RD, counts_L, counts_dev_L)
        return self.forward_loop(x_RD, counts_L)

    def _norm_params(self, index=None) -> tuple[Tensor | None, Tensor | None]:
        if self.norm_weight is None:
            return None, None
        return (self.norm_weight, self.norm_bias) if index is None else (self.norm_weight[index],
                                                                           self.norm_bias[index])

    def _batched(self, x_LcD: Tensor) -> Tensor:
        w, b = self._norm_params()
        if w is not None and w.shape[0] == 1:  # one local expert: its affine LayerNorm, fused
            w, b = w[0], b[0]
        elif w is not None:
            w, b = w[:, None], b[:, None]
        x_LcD = _expert_layer_norm(x_LcD, w, b)
        h_LcF = self.activation(torch.baddbmm(self.b1[:, None], x_LcD, self.w1))
        return torch.baddbmm(self.b2[:, None], h_LcF, self.w2)

    def _grouped(self, x_RD: Tensor, counts_L: list[int], counts_dev_L: Tensor | None = None) -> Tensor:
        """Rows grouped by expert (counts_L rows each) through one grouped matmul per projection; the
        biases and LayerNorm affines are gathered per row. The offsets come from the counts on the
        device (counts_dev_L); without them the host counts are copied there (a copy that waits)."""
        L, R = len(counts_L), x_RD.shape[0]
        counts = counts_dev_L.to(x_RD.device) if counts_dev_L is not None else torch.tensor(counts_L,
                                                                                            device=x_RD.device)
        offs_L = torch.cumsum(counts, 0).to(torch.int32)
        expert_R = torch.repeat_interleave(torch.arange(L, device=x_RD.device), counts, output_size=R)
        x_RD = _expert_layer_norm(x_RD, *self._norm_params(expert_R))
        h_RF = self.activation(_grouped_matmul(x_RD, self.w1, offs_L) + self.b1[expert_R])
        return _grouped_matmul(h_RF, self.w2, offs_L) + self.b2[expert_R]

    def forward_tiled(self, x_RD: Tensor, counts_L: list[int]) -> Tensor:
        """Each expert's rows in tiles of TILE_ROWS rows, one fixed-shape product per tile
        (`tiled_expert_linear`): a row's result depends on its own values only, so later tokens, which
        change the counts, cannot change earlier outputs (the bit-exact causality check). Evaluation
        uses it wherever the counts depend on the data. Costs the padding, at most L (TILE_ROWS - 1) rows."""
        norms = zip(*(p.unbind(0) for p in self._norm_params())) if self.norm_weight is not None else None
        chunks_L = _split_rows(x_RD, counts_L)
        if norms is not None:
            chunks_L = [_expert_layer_norm(chunk, w, b) for chunk, (w, b) in zip(chunks_L, norms)]
        x_PD, tiles_L = pad_to_tiles(chunks_L)
        h_PF = self.activation(tiled_expert_linear(x_PD, tiles_L, self.w1.unbind(0), self.b1.unbind(0)))
        y_PD = tiled_expert_linear(h_PF, tiles_L, self.w2.unbind(0), self.b2.unbind(0))
        return unpad_tiles(y_PD, counts_L, tiles_L)

    def _one_expert(self, x_RD: Tensor, w1, b1, w2, b2, norm_w, norm_b) -> Tensor:
        """One expert on its rows, from its weights (D, F), (F,), (F, D), (D,) and LayerNorm affines."""
        h = self.activation(torch.addmm(b1, _expert_layer_norm(x_RD, norm_w, norm_b), w1))
        return torch.addmm(b2, h, w2)

    def expert_rows(self, x_RD: Tensor, l: int) -> Tensor:
        """Local expert l on rows x, (R, D): the cached decoding step's product (moe.TMoE.step), on views
        of the stacked weights (decoding has no backward pass to pay for indexing them). Without a grad the
        views are made once and kept while the weights are the same tensors (`_per_expert`)."""
        if torch.is_grad_enabled():
            return self._one_expert(x_RD, self.w1[l], self.b1[l], self.w2[l], self.b2[l], *self._norm_params(l))
        return self._one_expert(x_RD, *self._per_expert()[l])

    def _per_expert(self) -> list[tuple]:
        """Each local expert's (w1, b1, w2, b2, norm weight, norm bias) as views of the stacked weights, made once
        (no operator per decoding step) and again whenever a weight is another tensor or storage (a load that
        assigns, `.to()`, a dtype change): in-place updates reach the views by themselves."""
        params = (self.w1, self.b1, self.w2, self.b2, self.norm_weight, self.norm_bias)
        key = tuple((id(p), p.data_ptr(), p.dtype) if p is not None else None for p in params)
        if self._unbound is None or self._unbound[0] != key:
            L = self.w1.shape[0]
            with torch.no_grad():
                views = [p.unbind(0) if p is not None else (None,) * L for p in params]
            self._unbound = (key, list(zip(*views)))
        return self._unbound[1]

    def forward_loop(self, x_RD: Tensor, counts_L: list[int]) -> Tensor:
        """One product per local expert: the reference the other forms are tested against. The weights are
        unbound once (indexing them per expert would give each expert's gradient a zero-filled copy of the
        whole stack)."""
        L = len(counts_L)
        params = [p.unbind(0) for p in (self.w1, self.b1, self.w2, self.b2)]
        norms = [p.unbind(0) for p in self._norm_params()] if self.norm_weight is not None else [[None] * L] * 2
        outs = [self._one_expert(chunk, *(p[l] for p in params), norms[0][l], norms[1][l])
                for l, chunk in enumerate(_split_rows(x_RD, counts_L))]
        return torch.cat(outs, dim=0) if len(outs) != 1 else outs[0]


class SpatialExperts(nn.Module):
    """L sMoE experts, each one causal spatial projection over positions (one SGU head).

    A row is one hidden dimension of one sequence: a vector over M <= T positions. An expert
    returns its gate minus one, W x + (b - 1), as the SGU's projection does (gmlp.py): at the
    near-identity init W x is ~1e-5 and 1 + W x would round to exactly 1 in bf16 and fp16, in
    the expert and in the all2all that carries the rows back. The sMoE adds the one. The bias is
    stored as b - 1 (`bias_offset`, as the SGU's: gmlp.py).
    """

    def __init__(self, num_local_experts: int, size: int, init_eps: float = 1e-3, first_expert: int = 0, *,
                 replicated: bool = False):
        super().__init__()
        self.size = size
        self.weight = nn.Parameter(torch.empty(num_local_experts, size, size))
        self.bias_offset = nn.Parameter(torch.empty(num_local_experts, size))  # b - 1
        init_spatial_(self.weight, self.bias_offset, init_eps, _expert_generators(num_local_experts, first_expert))
        if not replicated:  # replicated: every rank holds every expert, averaged as data-parallel parameters
            mark_expert(self)
        self.explicit_spatial = False  # the masked dense product, for FLOP counting (flop_forms.py)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        load_gate_bias_offset(state_dict, prefix)  # checkpoints that stored b itself
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x_RM: Tensor, counts_L: list[int]) -> Tensor:
        M = x_RM.shape[-1]
        check_length(M, self.size, "sMoE row")
        if self.explicit_spatial:
            return self.forward_dense(x_RM, counts_L)
        _check_counts(x_RM, counts_L)
        # one blocked causal product for all local experts; the rows are read positions first, in place
        y_RM = causal_product_rows(self.weight, x_RM, counts_L)
        L, c = len(counts_L), _equal_count(counts_L)
        if c is not None:
            return (y_RM.view(L, c, M) + self.bias_offset[:, None, :M]).view(L * c, M)
        # each expert's bias on its rows: one concatenation of broadcast views (no counts copied to the device)
        dev_LM = self.bias_offset[:, :M]
        return y_RM + torch.cat([dev_LM[l].expand(c, M) for l, c in enumerate(counts_L)])

    def forward_dense(self, x_RM: Tensor, counts_L: list[int]) -> Tensor:
        """The masked dense form, one matmul per expert (the paper's FLOP convention, and the reference)."""
        M = x_RM.shape[-1]
        w_LMM, offset = causal_weight(self.weight, M).unbind(0), self.bias_offset.unbind(0)
        outs = [chunk @ w_LMM[l].t() + offset[l][:M]
                for l, chunk in enumerate(_split_rows(x_RM, counts_L))]
        return torch.cat(outs, dim=0)

    def step_chunks(self, v_BtC: Tensor, start: int) -> Tensor:
        """Cached decoding with every expert here and chunk i of the C channels routed to expert i
        (deterministic routing): W x + (b - 1) at positions start..t-1, (B, k, C), from the cache in place."""
        check_length(v_BtC.shape[1], self.size, "sMoE row")
        return causal_step(self.weight, self.bias_offset, v_BtC, start)

    def step_routed(self, v_BmC: Tensor, expert_BC: Tensor) -> Tensor:
        """Cached decoding of one new position with every expert here, each (sequence, channel) routed to
        expert_BC (B, C): W_e[m - 1, :m] . v + (b_e - 1) at the row's last position, (B, C), v_BmC the m
        positions the experts mix."""
        m = v_BmC.shape[1]
        check_length(m, self.size, "sMoE row")
        w_BCm = self.weight[expert_BC, m - 1, :m]
        return (w_BCm * v_BmC.transpose(1, 2)).sum(-1) + self.bias_offset[expert_BC, m - 1]

    def step(self, x_RM: Tensor, counts_LW: list[list[int]], spans_W: list[tuple[int, int]]) -> Tensor:
        """Cached decoding: only the positions each row's source rank asked for, (R, k).

        Rows arrive grouped by local expert, then by source rank (counts_LW[l][w] rows); the rows
        of source rank w hold its positions 0..hi_w-1 (zero-padded to the common width) and want
        outputs at positions lo_w..hi_w-1: W[lo:hi, :hi] (diagonal shifted by lo) times the row,
        O(hi) per output position. k = the widest span; narrower spans are zero-padded on the right.
        Like `forward` it returns the gate minus one, W x + (b - 1).
        """
        k = max((hi - lo for lo, hi in spans_W), default=0)
        if sum(map(sum, counts_LW)) != x_RM.shape[0]:
            raise ValueError(f"expert counts {counts_LW} do not add up to the {x_RM.shape[0]} rows received")
        y_Rk = x_RM.new_zeros(x_RM.shape[0], k)
        r = 0
        for l, counts_W in enumerate(counts_LW):
            for (lo, hi), c in zip(spans_W, counts_W):
                if c and hi > lo:
                    check_length(hi, self.size, "sMoE row")
                    w_kM = torch.tril(self.weight[l, lo:hi, :hi], diagonal=lo)
                    y_Rk[r:r + c, :hi - lo] = x_RM[r:r + c, :hi] @ w_kM.t() + self.bias_offset[l, lo:hi]
                r += c
        return y_Rk
