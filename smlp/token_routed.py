"""gMLP extended to token-level routing: sMLP Appendix A, Figure 6 (right), Table 7.

The straightforward way to make gMLP sparse is the token routing of the Transformer MoEs: each
token goes to one expert (one device), and every expert is a whole gMLP block body with its own
Spatial Gating Unit. The paper's argument against it (Appendix A): "tokens can only attend to
previous tokens which were sent to the same device", so the more experts, the fewer tokens each
one can mix, and Table 7 finds perplexity worse with 32 and 64 experts than dense gMLP.

    h = LayerNorm(x)                                  (shared)
    e(t) = argmax_e softmax(h_t W_r)_e, p_t = that probability   (per token: causal)
    y_t = p_t * Expert_e(t)(h)_t,   x_t <- x_t + y_t
    Expert_e(h)_t = W_out [ z1_t * ( sum_{s <= t, e(s) = e} W_e[t, s] LN_e(z2_s) + b_e[t] ) ],
    (z1, z2) = split(GELU(W_in h)), for the tokens t routed to e only.

Positions keep their place in the sequence: the spatial weight W_e is indexed by the tokens'
original positions (a token at position 40 that is the 3rd token routed to e uses row 40 of
W_e), so an expert loses the tokens routed elsewhere, not the position information. With one
expert every token goes to it with p = 1 and the block is exactly the dense gMLP block (tested
with the same weights).

The router is Switch's top-1 gate with no capacity (`switch_top1(capacity_factor=None)`), its
logits in fp32 (`router_logits`): a token's expert depends on its own representation only, in
training as at inference, so the block is causal, and Switch's load-balancing loss (kept in
`aux_loss`, read by the criterion) keeps the experts in use. A balanced assignment or a
capacity limit would couple the tokens of a batch.

Computation, with shapes that never depend on later tokens (the causality check compares
outputs bit for bit, and a matrix product of another shape may round differently: on some CPUs a
product with 1-3 rows takes another kernel than one with more):
1. Channel projections, per expert, in tiles of TILE_ROWS rows: the rows are sorted by expert and
   each expert's rows padded to whole tiles; every tile is one (TILE_ROWS x D) @ (D x F) product of a batched
   product (`tiled_expert_linear`, experts.py, which the FFN experts use at evaluation too), so a
   row's result depends on its own values only, whatever the number of rows routed with it.
   Padding costs at most E (TILE_ROWS - 1) rows.
2. Spatial mixing in the positions' own layout: row t of the mixing matrix of a sequence is row t
   of W_e(t), kept where s <= t and e(s) = e(t), so one (n x n) @ (n x C) product per sequence
   mixes every expert at once: the dense SGU's cost, whatever the routing.
3. Every expert's parameters take part in every forward (stacked for step 2, passed whole to
   step 1), so an expert that receives no token still gets a (zero) gradient: DDP's
   `pytorch_ddp` backend sees no unused parameter.
The SGU returns the gate minus one, W v + (b - 1), and the unit computes z1 + z1 * (W v + (b - 1))
as the dense SGU does (gmlp.py, half precision). The experts are replicated on every rank
(data parallel, no all2all): Table 7 is a claim about quality, not speed. Under
`explicit_spatial` (the FLOP counter) the projections run on exactly the routed rows, so the
count is the padding-free one the analytic formula gives.

Shapes: the core's legend (smlp/__init__.py); here B batch, N positions (n <= T), S = B n rows,
D model width, F channel-projection width, C = F/2, E experts, R rows the experts compute (S
padded to whole tiles of TILE_ROWS rows).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function

from .config import TokenRoutedGMLPConfig
from .experts import TILE_ROWS, tile_slots, tiled_expert_linear
from .gmlp import SpatialGatingUnit
from .profiling import RANGES
from .routing.gates import switch_top1
from .routing.logits import router_logits
from .spatial import check_length

__all__ = ["TokenRoutedGMLPBlock", "GMLPExpert", "TILE_ROWS", "tile_slots"]


def _expert_linear(x_SD: Tensor, slot_S: Tensor, tiles_E: list[int], linears: list[nn.Linear],
                   rows: int = TILE_ROWS) -> Tensor:
    """Row s through linears[e(s)] (slot_S, tiles_E from `tile_slots`), in tiles of `rows` rows."""
    x_RD = x_SD.new_zeros(sum(tiles_E) * rows, x_SD.shape[1]).index_copy(0, slot_S, x_SD)
    return tiled_expert_linear(x_RD, tiles_E, [m.weight.t() for m in linears], [m.bias for m in linears],
                               rows)[slot_S]


class GMLPExpert(nn.Module):
    """One expert's parameters: a gMLP block body (proj_in, sgu, proj_out) as in `GMLPBlock`, so a
    dense block's weights copy in. The block runs all experts at once (TokenRoutedGMLPBlock)."""

    def __init__(self, cfg: TokenRoutedGMLPConfig):
        super().__init__()
        self.proj_in = nn.Linear(cfg.d_model, cfg.d_ffn)
        self.sgu = SpatialGatingUnit(cfg.expert.sgu)
        self.proj_out = nn.Linear(cfg.d_ffn // 2, cfg.d_model)


class TokenRoutedGMLPBlock(nn.Module):
    """gMLP block with token-routed experts (module docstring); residual inside, as GMLPBlock."""

    def __init__(self, cfg: TokenRoutedGMLPConfig):
        super().__init__()
        self.cfg = cfg
        self.norm = nn.LayerNorm(cfg.d_model)
        self.gate = nn.Linear(cfg.d_model, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(GMLPExpert(cfg) for _ in range(cfg.num_experts))
        self.dropout = nn.Dropout(cfg.dropout)
        self.aux_loss: Tensor | None = None
        self.load_E: Tensor | None = None
        self.comm_seconds = 0.0
        self.explicit_spatial = False  # FLOP counting: projections on the routed rows only (module docstring)
        self.layer_name = f"TokenRoutedGMLPBlock ({cfg.num_experts} experts)"

    def _projection(self, x_SD: Tensor, expert_S: Tensor, tiling, modules: list[nn.Module]) -> Tensor:
        """Row s through modules[e(s)]: in tiles (`tiling` from `tile_slots`), or under
        `explicit_spatial` as the plain loop over the routed rows."""
        if not self.explicit_spatial:
            return _expert_linear(x_SD, *tiling, modules)
        y = None
        for e, m in enumerate(modules):  # the plain loop: exactly the routed rows (FLOP counting)
            idx = (expert_S == e).nonzero().squeeze(1)
            y_e = m(x_SD[idx])
            y = x_SD.new_zeros(x_SD.shape[0], y_e.shape[1]) if y is None else y
            y = y.index_copy(0, idx, y_e)
        return y

    def forward(self, x_BND: Tensor) -> Tensor:
        B, n, D = x_BND.shape
        check_length(n, self.cfg.seq_len)
        E, S = self.cfg.num_experts, B * n
        h_BND = self.norm(x_BND)
        with record_function(RANGES["routing"]):
            plan = switch_top1(router_logits(h_BND.reshape(S, D), self.gate.weight.t()), capacity_factor=None,
                               training=self.training, layer=self.layer_name)
        self.aux_loss = plan.aux_loss if self.training else None
        self.load_E = plan.counts(E).detach()
        expert_S = plan.experts_SK[:, 0]
        weight_S = plan.weights_SK[:, 0].to(x_BND.dtype)
        with record_function(RANGES["experts"]):
            tiling = tile_slots(expert_S, E) if not self.explicit_spatial else None
            z_SF = F.gelu(self._projection(h_BND.reshape(S, D), expert_S, tiling, [x.proj_in for x in self.experts]))
            z1_SC, z2_SC = z_SF.chunk(2, dim=-1)
            with record_function(RANGES["token_mixing"]):
                dev_SC = self._spatial(z2_SC, expert_S.view(B, n))
            y_SD = self._projection(z1_SC + z1_SC * dev_SC, expert_S, tiling, [x.proj_out for x in self.experts])
        return x_BND + self.dropout((y_SD * weight_S[:, None]).view(B, n, D))

    def _spatial(self, z2_SC: Tensor, expert_BN: Tensor) -> Tensor:
        """Each token's SGU with its expert's LayerNorm and spatial weight, over the earlier tokens
        routed to the same expert (step 2 of the module docstring): the gate minus one, (S, C)."""
        B, n = expert_BN.shape
        C = z2_SC.shape[-1]
        sgus = [x.sgu for x in self.experts]
        expert_S = expert_BN.reshape(-1)
        if self.explicit_spatial:  # the plain loop (FLOP counting: each expert's LayerNorm on its rows)
            v_SC = self._projection(z2_SC, expert_S, None, [s.norm for s in sgus])
        else:
            gamma_EC = torch.stack([s.norm.weight for s in sgus])
            beta_EC = torch.stack([s.norm.bias for s in sgus])
            v_SC = F.layer_norm(z2_SC, (C,), eps=sgus[0].norm.eps) * gamma_EC[expert_S] + beta_EC[expert_S]
        w_ENN = torch.stack([s.proj.weight[0, :n, :n] for s in sgus])
        offset_EN = torch.stack([s.proj.bias_offset[0, :n] for s in sgus])  # b - 1
        pos_N = torch.arange(n, device=z2_SC.device)
        keep_BNN = (expert_BN[:, :, None] == expert_BN[:, None, :]) & (pos_N[:, None] >= pos_N[None, :])
        w_BNN = torch.where(keep_BNN, w_ENN[expert_BN, pos_N], 0)  # row t: W_e(t)[t, s] where it mixes
        v_BNC = v_SC.view(B, n, C)
        # under explicit_spatial the product is counted as the dense SGU's (the same einsum: fvcore's rule)
        mix_BNC = torch.einsum("bts,bsc->btc", w_BNN, v_BNC) if self.explicit_spatial else torch.bmm(w_BNN, v_BNC)
        dev_BNC = mix_BNC + offset_EN[expert_BN, pos_N][..., None]
        return dev_BNC.reshape(B * n, C)
