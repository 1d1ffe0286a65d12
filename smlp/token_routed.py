"""gMLP with token-level routing: sMLP Appendix A, Figure 6 (right), Table 7.

Each token goes to one expert, a whole gMLP block body with its own Spatial Gating Unit, and mixes
only with the earlier tokens routed to the same expert (the paper's case against this design):

    h = LayerNorm(x),  (z1, z2) = split(GELU(W_in,e(t) h_t)),  e(t), p_t = Switch top-1 of h_t W_r
    x_t <- x_t + p_t W_out,e(t) [ z1_t * (sum_{s<=t, e(s)=e(t)} W_e(t)[t, s] LN_e(t)(z2_s) + b_e(t)[t]) ]

W_e is indexed by original positions; with one expert the block is the dense gMLP block. The router
has no capacity limit, so the block is causal. The causality test compares bit for bit, so no
product's shape depends on later tokens: the channel projections run in tiles of TILE_ROWS rows,
the spatial mixing as one (n x n) product per sequence for all experts. Every expert joins every
forward, so DDP sees no unused parameter. The experts are replicated on every rank (no all2all):
Table 7 is about quality, not speed.

Shapes: the core's legend (smlp/__init__.py); here S = B n rows, C = F/2, R = S padded to whole tiles.
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
from .recompute import recomputed
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
    """One expert's parameters: a gMLP block body (proj_in, sgu, proj_out) named as in `GMLPBlock`."""

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
        self.explicit_spatial = False  # FLOP counting: projections on the routed rows only, no tile padding
        self.recompute = False  # activation checkpointing: the experts again in backward (recompute.py)
        self.layer_name = f"TokenRoutedGMLPBlock ({cfg.num_experts} experts)"

    def _projection(self, x_SD: Tensor, expert_S: Tensor, tiling, modules: list[nn.Module]) -> Tensor:
        """Row s through modules[e(s)]: in tiles (`tiling` from `tile_slots`), or as a plain loop."""
        if not self.explicit_spatial:
            return _expert_linear(x_SD, *tiling, modules)
        y = None
        for e, m in enumerate(modules):
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

            def experts(h_SD: Tensor) -> Tensor:
                z_SF = F.gelu(self._projection(h_SD, expert_S, tiling, [x.proj_in for x in self.experts]))
                z1_SC, z2_SC = z_SF.chunk(2, dim=-1)
                with record_function(RANGES["token_mixing"]):
                    dev_SC = self._spatial(z2_SC, expert_S.view(B, n))
                return self._projection(z1_SC + z1_SC * dev_SC, expert_S, tiling, [x.proj_out for x in self.experts])

            y_SD = recomputed(self.recompute, experts, h_BND.reshape(S, D))
        return x_BND + self.dropout((y_SD * weight_S[:, None]).view(B, n, D))

    def _spatial(self, z2_SC: Tensor, expert_BN: Tensor) -> Tensor:
        """Each token's SGU with its expert's LayerNorm and spatial weight, over the earlier tokens
        routed to the same expert: the gate minus one, W v + (b - 1), (S, C)."""
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
        # the einsum is counted as the dense SGU's product
        mix_BNC = torch.einsum("bts,bsc->btc", w_BNN, v_BNC) if self.explicit_spatial else torch.bmm(w_BNN, v_BNC)
        dev_BNC = mix_BNC + offset_EN[expert_BN, pos_N][..., None]
        return dev_BNC.reshape(B * n, C)
