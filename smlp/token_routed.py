"""gMLP extended to token-level routing: sMLP Appendix A, Figure 6 (right), Table 7.

The straightforward way to make gMLP sparse is the token routing of the Transformer MoEs: each
token goes to one expert (one device), and every expert is a whole gMLP block body with its own
Spatial Gating Unit. The paper's argument against it (Appendix A): "tokens can only attend to
previous tokens which were sent to the same device", so the more experts, the fewer tokens each
one can mix, and Table 7 finds perplexity worse with 32 and 64 experts than dense gMLP.

    h = LayerNorm(x)                                  (shared)
    e(t) = argmax_e softmax(h_t W_r)_e, p_t = that probability   (per token: causal)
    y_t = p_t * Expert_e(t)(h)_t,   x_t <- x_t + y_t
    Expert_e(h)_t = W_out [ z1_t * ( sum_{s <= t, e(s) = e} W_e[t, s] LN(z2_s) + b_e[t] ) ],
    (z1, z2) = split(GELU(W_in h)), for the tokens t routed to e only.

Positions keep their place in the sequence: the spatial weight W_e is indexed by the tokens'
original positions (a token at position 40 that is the 3rd token routed to e uses row 40 of
W_e), so an expert loses the tokens routed elsewhere, not the position information. With one
expert every token goes to it with p = 1 and the block is exactly the dense gMLP block (tested
with the same weights).

The router is Switch's top-1 gate with no capacity (`switch_top1(capacity_factor=None)`): a
token's expert depends on its own representation only, in training as at inference, so the block
is causal, and Switch's load-balancing loss (kept in `aux_loss`, read by the criterion) keeps the
experts in use. A balanced assignment or a capacity limit would couple the tokens of a batch.

Computation: for each expert, the tokens routed to it are packed per sequence (in position
order, padded to the longest count K_e in the batch), so the channel projections cost what one
dense block costs in total. The spatial sum of a packed token runs over T slots (its earlier
routed tokens, then zeros): a sum whose length depended on how many later tokens were routed to
the same expert would round differently when the future changes, and the causality check
compares outputs bit for bit. So the mixing costs sum_e K_e T C per sequence, n T C in all: what
the dense SGU costs (n^2 C / E would be the packed minimum). The experts are replicated on every
rank (data parallel, no all2all): Table 7 is a claim about quality, not speed.

Shapes: B batch, N positions (n <= T), D model width, F channel-projection width, C = F/2,
E experts, K tokens of one sequence routed to one expert (padded).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function

from .config import TokenRoutedGMLPConfig
from .gates import switch_top1
from .mixers import SpatialGatingUnit, check_length
from .profiling import RANGES

__all__ = ["TokenRoutedGMLPBlock", "GMLPExpert", "pack_routed_positions"]


def pack_routed_positions(expert_BN: Tensor, e: int) -> tuple[Tensor, Tensor, Tensor]:
    """Positions of the tokens routed to expert e, packed to the left in position order.

    Returns (positions_BK, valid_BK, counts_B) with K the largest count in the batch; padded slots
    hold positions of tokens not routed to e (never read: valid is False there)."""
    B, n = expert_BN.shape
    pos_N = torch.arange(n, device=expert_BN.device)
    mine_BN = expert_BN == e
    counts_B = mine_BN.sum(dim=1)
    K = int(counts_B.max()) if B else 0
    # routed positions sort first (key = position), the others after them (key = position + n)
    order_BN = torch.argsort(torch.where(mine_BN, pos_N, pos_N + n), dim=1, stable=True)
    positions_BK = order_BN[:, :K]
    valid_BK = torch.arange(K, device=expert_BN.device)[None, :] < counts_B[:, None]
    return positions_BK, valid_BK, counts_B


class GMLPExpert(nn.Module):
    """One expert: a gMLP block body whose SGU mixes only the tokens routed to it.

    Attribute names as in `GMLPBlock` (proj_in, sgu, proj_out), so a dense block's weights copy in."""

    def __init__(self, cfg: TokenRoutedGMLPConfig):
        super().__init__()
        self.proj_in = nn.Linear(cfg.d_model, cfg.d_ffn)
        self.sgu = SpatialGatingUnit(cfg.expert.sgu)
        self.proj_out = nn.Linear(cfg.d_ffn // 2, cfg.d_model)

    def forward(self, h_BKD: Tensor, positions_BK: Tensor, valid_BK: Tensor) -> Tensor:
        z_BKF = F.gelu(self.proj_in(h_BKD))
        z1_BKC, z2_BKC = z_BKF.chunk(2, dim=-1)
        with record_function(RANGES["token_mixing"]):
            v_BKC = self.sgu.norm(z2_BKC)
            w_TT, b_T = self.sgu.proj.weight[0], self.sgu.proj.bias[0]
            B, K, C = v_BKC.shape
            T = w_TT.shape[0]
            # W_e at the original positions: row t, column s of every (routed token, earlier routed token);
            # the sum runs over a fixed length so its rounding does not depend on how many later tokens
            # were routed here (the causality check compares outputs bit for bit)
            w_BKK = w_TT[positions_BK[:, :, None], positions_BK[:, None, :]]
            keep_BKK = torch.ones(K, K, dtype=torch.bool, device=h_BKD.device).tril()[None] & valid_BK[:, None, :]
            w_BKT = F.pad(w_BKK * keep_BKK, (0, T - K))
            v_BTC = F.pad(v_BKC, (0, 0, 0, T - K))
            gate_BKC = torch.einsum("bts,bsc->btc", w_BKT, v_BTC) + b_T[positions_BK][..., None]
        return self.proj_out(z1_BKC * gate_BKC)


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
        self.layer_name = f"TokenRoutedGMLPBlock ({cfg.num_experts} experts)"

    def forward(self, x_BND: Tensor) -> Tensor:
        B, n, D = x_BND.shape
        check_length(n, self.cfg.seq_len)
        h_BND = self.norm(x_BND)
        with record_function(RANGES["routing"]):
            plan = switch_top1(self.gate(h_BND).reshape(B * n, -1), capacity_factor=None, training=self.training,
                               layer=self.layer_name)
        self.aux_loss = plan.aux_loss if self.training else None
        self.load_E = plan.counts(self.cfg.num_experts).detach()
        expert_BN = plan.experts_SK[:, 0].view(B, n)
        weight_BN = plan.weights_SK[:, 0].view(B, n).to(x_BND.dtype)
        y_BND = torch.zeros_like(x_BND)
        with record_function(RANGES["experts"]):
            for e, expert in enumerate(self.experts):
                positions_BK, valid_BK, _ = pack_routed_positions(expert_BN, e)
                if positions_BK.shape[1] == 0:
                    continue
                index_BKD = positions_BK[..., None].expand(-1, -1, D)
                out_BKD = expert(h_BND.gather(1, index_BKD), positions_BK, valid_BK)
                scale_BK = weight_BN.gather(1, positions_BK) * valid_BK
                y_BND = y_BND.scatter_add(1, index_BKD, out_BKD * scale_BK[..., None])
        return x_BND + self.dropout(y_BND)
