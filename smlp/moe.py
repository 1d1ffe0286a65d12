"""MoE layers composed as router -> dispatch -> experts -> combine.

tMoE (token-routed FFN experts, sMLP section 2.2 / 3.1) and sMoE (hidden-dimension-routed
spatial experts, sections 3.1-3.2), and the sMLP sparse block that stacks them.

Shape legend:
    B batch, N positions (n <= T), D model width, C gated channels of the sMoE,
    S rows routed on this rank, E experts (global), P routing-prefix positions (partial prediction).

Auxiliary losses, load and all2all time are kept on the module after each forward
(`aux_loss`, `z_loss`, `load_E`, `dropped`, `comm_seconds`) for the criterion and the logs to
read; nothing lives in globals. They stay on the device (load_E) or as timing events (comm_seconds, read when it is
asked for): a forward reads nothing on the host but the split sizes of its dispatches
(dispatch.py), and the routers' input checks travel with those (routing.py).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function

from .config import SMoEConfig, SparseBlockConfig, TMoEConfig
from .decoding_cache import cache_append
from .dispatch import LocalDispatcher
from .experts import FFNExperts, SpatialExperts
from .profiling import RANGES
from .routing.assignment import balanced_assignment
from .routing.gates import router_z_loss
from .routing.logits import router_logits
from .routing.plan import RoutingPlan, count_rows
from .routing.registry import SMOE_ROUTINGS, TOKEN_ROUTERS, hash_table  # noqa: F401  (hash_table: re-exported)
from .spatial import check_length

__all__ = ["TMoE", "SMoE", "SparseBlock", "hash_table", "LEAKY_ROUTING_WARNING"]

logger = logging.getLogger(__name__)
LEAKY_ROUTING_WARNING = (
    "sMoE routing 'leaky-full-sequence' (sMLP Appendix B, Figure 7) reads all T positions of every hidden vector "
    "to route it: the output at position t depends on tokens after t. The model SEES THE FUTURE; its perplexity "
    "is not a language model's. Use it only to reproduce Figure 7.")


def _check_dispatcher(dispatcher, num_experts: int):
    dispatcher = dispatcher if dispatcher is not None else LocalDispatcher(num_experts)
    if dispatcher.num_experts != num_experts:
        raise ValueError(
            f"the dispatcher was built for {dispatcher.num_experts} experts but the layer has {num_experts}"
        )
    return dispatcher


class TMoE(nn.Module):
    """Token-routed FFN experts; returns only the expert branch (the caller adds the residual).

    base:   Base Layers (Lewis et al. 2021) as fairseq's `BaseLayer` runs it:
            y = sigmoid(x.c_e) * FFN_e(LN_e(x)). Added to x this is
            sigmoid * expert_sublayer(x) + (1 - sigmoid) * x, fairseq's form. In training the
            tokens are shuffled to random ranks (`shuffle`, fairseq's --base-shuffle) and
            assigned there with exact balance (every expert gets the same number of tokens);
            at inference each token goes to its best expert (greedy top-1). Only the routing
            scores travel through the shuffle (`_shuffled_assignment`): the assignment needs
            nothing else, so the tokens go from home straight to their expert and back, one
            exchange each way instead of fairseq's two (same assignment, outputs and
            gradients as fairseq's layer; tests/test_distributed.py). Why both: balance
            is what makes Base Layers train without an auxiliary loss, but a balanced
            assignment couples the tokens of a batch (the expert of token t depends on later
            tokens), which a causal LM cannot do when generating; greedy routing is per token.
            The expert's second projection starts at zero (fairseq's `BaseSublayer`).
    switch: y = p_e(x) * FFN_e(x) for the top-1 expert, over-capacity tokens get y = 0.
    gshard: y = sum over top-2 of normalized p * FFN_e(x), capacity 2S/E; the load-balancing
            loss is E^2 * mean_e(m_e c_e) by default (1 when balanced, as Switch's).
    hash:   y = FFN_e(x) with e = table[token id].
    """

    def __init__(self, cfg: TMoEConfig, dispatcher=None):
        super().__init__()
        self.cfg = cfg
        self.dispatcher = _check_dispatcher(dispatcher, cfg.num_experts)
        self.token_router = TOKEN_ROUTERS[cfg.router]  # the registry entry: parameters, route, capacity (routers.py)
        self.token_router.init(self, cfg)
        D = cfg.d_model
        self.experts = FFNExperts(self.dispatcher.num_local_experts, D, cfg.d_ffn, activation=cfg.activation,
                                  norm=cfg.uses_expert_norm, zero_output=cfg.uses_zero_init_output,
                                  first_expert=self.dispatcher.first_expert)
        self.aux_loss: Tensor | None = None
        self.logits_SE: Tensor | None = None  # the softmax gates' logits of the last forward (z_loss)
        self.load_E: Tensor | None = None  # rows each expert computed (kept slots), on the device
        self.dropped: Tensor | None = None  # slots over capacity (Switch, GShard), on the device
        self.slots = 0  # routing slots of the last forward (tokens x choices): the denominator of `dropped`
        self.comm_time = None  # the dispatcher's timed sections of the last forward (CommTime)
        self.layer_name = f"TMoE ({cfg.router} router)"  # LanguageModel sets the module path, for errors

    @property
    def comm_seconds(self) -> float:
        """All2all time of the last forward (0 unless the dispatcher's timer is enabled)."""
        return self.comm_time.seconds if self.comm_time is not None else 0.0

    @property
    def z_loss(self) -> Tensor | None:
        """The router z-loss (ST-MoE) of the last forward's logits (Switch, GShard; None otherwise),
        computed when asked: a forward whose criterion does not ask builds none of its graph."""
        return router_z_loss(self.logits_SE) if self.logits_SE is not None else None

    def route(self, x_SD: Tensor, token_ids_S: Tensor | None = None, *, defer_checks: bool = False) -> RoutingPlan:
        """The routing plan of the rows; defer_checks leaves the router's input check in the plan
        (read by the dispatcher) instead of reading it here. router_logits computes the gate
        projection itself in fp32, whatever the model dtype (numerics.py); the router's route
        function is in the registry (routers.py)."""
        return self.token_router.route(self, x_SD, token_ids_S, defer_checks)

    def _shuffled_assignment(self, scores_SE: Tensor) -> Tensor:
        """Base Layers' training-time assignment (fairseq's `base_shuffle`), moving routing metadata only.

        fairseq's BaseLayer sends every token to a random rank, assigns there, sends it to its
        expert, back, and home: two token exchanges each way, and their reverses in backward.
        The assignment reads only the tokens' scores, so:
        1. send the scores (S x E, fp32, no gradient) through the shuffle: the same random
           permutation and split as fairseq's tokens (dispatcher.shuffle);
        2. assign with exact balance over the rows that arrive, as fairseq assigns the tokens
           that arrive (the same scores in the same order: the same assignment);
        3. send each row's expert back to its home rank (dispatcher.unshuffle).
        The tokens then go from home straight to their expert and back (`_route_and_compute`);
        the combine weight sigmoid(score) is taken at home, where the scores have their gradient.
        """
        with torch.no_grad():
            shuffled_SE, shuffle = self.dispatcher.shuffle(scores_SE.detach())
            expert_S = balanced_assignment(shuffled_SE)
            return self.dispatcher.unshuffle(expert_S, shuffle)

    def forward(self, x_SD: Tensor, token_ids_S: Tensor | None = None) -> Tensor:
        if x_SD.dim() != 2 or x_SD.shape[-1] != self.cfg.d_model:
            raise ValueError(f"TMoE expects rows of shape (S, {self.cfg.d_model}), got {tuple(x_SD.shape)}")
        mark = self.dispatcher.timer.mark()
        y_SD = self._route_and_compute(x_SD, token_ids_S)
        self.comm_time = self.dispatcher.timer.take(mark)
        return y_SD

    def _route_and_compute(self, x_SD: Tensor, token_ids_S: Tensor | None) -> Tensor:
        with record_function(RANGES["routing"]):
            plan = self.route(x_SD, token_ids_S, defer_checks=True)
        self.aux_loss = plan.aux_loss
        S, K = plan.experts_SK.shape
        # Every (row, slot) pair is dispatched, dropped slots (expert -1) too: the dispatcher sorts
        # them first and cuts them off with the count it reads anyway, where a boolean mask here
        # would read the number kept on the host. Their weight is 0 and they combine as zeros.
        expert_idx = plan.experts_SK.reshape(-1)
        weight = plan.weights_SK.reshape(-1).to(x_SD.dtype)
        counts_E1 = count_rows(expert_idx, self.cfg.num_experts)
        self.load_E = counts_E1[1:].detach()
        self.dropped, self.slots = (counts_E1[0].detach(), S * K) if self.token_router.drops else (None, 0)
        row_idx = torch.arange(S, device=x_SD.device).repeat_interleave(K) if K > 1 else None
        x_rows = x_SD if row_idx is None else x_SD[row_idx]
        x_RD, counts_L, state = self.dispatcher.dispatch(x_rows, expert_idx, counts_E1=counts_E1,
                                                         fault_Q=plan.fault_Q, layer=self.layer_name)
        with record_function(RANGES["experts"]):
            y_RD = self.experts(x_RD, counts_L)
        y_rows = self.dispatcher.combine(y_RD, state)
        if row_idx is None:  # one slot per token: the rows are the tokens, in order
            return y_rows * weight[:, None]
        return torch.zeros_like(x_SD).index_add(0, row_idx, y_rows * weight[:, None])


class SMoE(nn.Module):
    """The sparse spatial-gating MoE: hidden-dimension vectors routed to spatial experts.

    out = z1 * gate, gate = expert_e(LayerNorm(z2)[c]) for each hidden dimension c.
    deterministic: c in chunk i -> expert i; with a LocalDispatcher and the same weights this is
                   exactly a multi-head SGU with one head per expert (the reference in the tests).
    partial:       logits_c = LayerNorm(z2)[:P, c] . W_r (P x E); each expert mixes only positions
                   P..n-1 and its output is scaled by p_e (eq. 5, 7); positions < P are not
                   predicted (gate = 1) and the LM loss must skip them. A sequence no longer
                   than P has no predicted position and sends no rows. Training assigns the
                   hidden dimensions with exact balance (every expert gets as many); inference
                   sends each to its most probable expert, per row, so nothing depends on the
                   rest of the batch.
    Both are causal: output at position t depends on positions <= t only.
    leaky-full-sequence (Appendix B, Figure 7): as partial, but the router (T x E) reads all
                   n positions and the experts mix all of them. The expert of a hidden dimension,
                   and its weight p_e, depend on future tokens: NOT causal (a warning is logged).
    """

    def __init__(self, cfg: SMoEConfig, dispatcher=None):
        super().__init__()
        self.cfg = cfg
        self.dispatcher = _check_dispatcher(dispatcher, cfg.num_experts)
        self.norm = nn.LayerNorm(cfg.gated_dim)
        self.experts = SpatialExperts(self.dispatcher.num_local_experts, cfg.expert_len, cfg.init_eps,
                                      first_expert=self.dispatcher.first_expert)
        self.routing = routing = SMOE_ROUTINGS[cfg.routing]  # the registry entry (routers.py)
        if routing.router_reads != "none":
            P = cfg.router_len
            self.router = nn.Parameter(torch.randn(P, cfg.num_experts) * P ** -0.5)
        if not routing.causal:
            logger.warning(LEAKY_ROUTING_WARNING)
        self.register_buffer(
            "channel_expert_C", routing.route(cfg.gated_dim, cfg.num_experts)
            if routing.router_reads == "none" else torch.empty(0, dtype=torch.long), persistent=False)
        self.load_E: Tensor | None = None
        self.aux_loss = self.z_loss = None  # no softmax gate: no z-loss
        self.dropped, self.slots = None, 0  # no capacity: nothing is dropped
        self.comm_time = None  # the dispatcher's timed sections of the last forward (CommTime)
        self.layer_name = f"SMoE ({cfg.routing} routing)"  # LanguageModel sets the module path, for errors

    @property
    def comm_seconds(self) -> float:
        """All2all time of the last forward (0 unless the dispatcher's timer is enabled)."""
        return self.comm_time.seconds if self.comm_time is not None else 0.0

    def forward(self, z_BNF: Tensor) -> Tensor:
        cfg = self.cfg
        if z_BNF.dim() != 3 or z_BNF.shape[-1] != cfg.dim:
            raise ValueError(f"SMoE expects (batch, length, {cfg.dim}), got {tuple(z_BNF.shape)}")
        B, n, _ = z_BNF.shape
        check_length(n, cfg.seq_len)
        P = min(cfg.prefix_len, n)  # a sequence no longer than the routing prefix has nothing to predict
        z1, z2 = z_BNF.chunk(2, dim=-1) if cfg.split else (z_BNF, z_BNF)
        v_BNC = self.norm(z2)
        C, M = v_BNC.shape[-1], n - P
        deterministic = self.routing.router_reads == "none"
        fault_Q, host_counts_E = None, None
        if deterministic:
            # rows ordered (channel, sequence): channel chunk i -> expert i, so the rows come sorted
            # by expert and the dispatcher neither sorts nor gathers them, and how many each expert
            # gets is known from the shapes (nothing to read from the device)
            rows_SM = v_BNC.permute(2, 0, 1).reshape(C * B, M)
            expert_S, weight_S = self.channel_expert_C.repeat_interleave(B), None
            host_counts_E = [C // cfg.num_experts * B] * cfg.num_experts
        elif M == 0:  # still take part in the exchange (other ranks may have rows), inside the graph:
            rows_SM = v_BNC[:, P:, :].reshape(B * C, 0)[:0]  # backward runs the matching exchange
            expert_S, weight_S = self.channel_expert_C.new_zeros(0), None
        else:
            rows_SM = v_BNC[:, P:, :].transpose(1, 2).reshape(B * C, M)  # one row per (sequence, channel)
            with record_function(RANGES["routing"]):
                if self.routing.router_reads == "all":  # Appendix B: every position, the future ones too
                    logits_SE = router_logits(rows_SM, self.router[:n])
                else:
                    prefix_SP = v_BNC[:, :P, :].transpose(1, 2).reshape(B * C, P)
                    logits_SE = router_logits(prefix_SP, self.router)
                plan = self.routing.route(logits_SE, training=self.training, layer=self.layer_name, defer_checks=True)
            expert_S, weight_S, fault_Q = plan.experts_SK[:, 0], plan.weights_SK[:, 0].to(z_BNF.dtype), plan.fault_Q
        counts_E1 = count_rows(expert_S, cfg.num_experts)
        self.load_E = counts_E1[1:].detach()
        mark = self.dispatcher.timer.mark()
        # ranks may hold sequences of different lengths: the dispatcher pads every rank's rows to the
        # widest (zero positions appended at the end never reach earlier outputs: causal)
        x_RM, counts_L, state = self.dispatcher.dispatch(rows_SM, expert_S, presorted=deterministic,
                                                         counts_E1=counts_E1, host_counts_E=host_counts_E,
                                                         fault_Q=fault_Q, layer=self.layer_name, common_width=True)
        with record_function(RANGES["token_mixing"]):  # the sMoE's experts mix positions
            y_RM = self.experts(x_RM, counts_L)
        y_SM = self.dispatcher.combine(y_RM, state)[:, :M]  # rows: gate minus one, W x + (b - 1) (SpatialExperts)
        self.comm_time = self.dispatcher.timer.take(mark)
        if weight_S is not None:
            y_SM = y_SM * weight_S[:, None]
        if deterministic:
            dev_BMC = y_SM.reshape(C, B, M).permute(1, 2, 0)
        else:
            dev_BMC = y_SM.reshape(B, C, M).transpose(1, 2)
        # gate = p (1 + dev): z1 p + z1 (p dev), the spatial term kept apart from the one (half precision)
        z1_BMC = z1[:, P:] if weight_S is None else z1[:, P:] * weight_S.reshape(B, 1, C)
        out_BMC = z1_BMC + z1[:, P:] * dev_BMC
        return torch.cat([z1[:, :P], out_BMC], dim=1) if P else out_BMC

    def step(self, z_BkF: Tensor, state: dict, start: int) -> Tensor:
        """Cached decoding of positions start..t-1 (eval routing; smlp/decoding_cache.py), (B, k, F or C).

        The normalized rows stay here, at the source rank; every step sends each row's prefix to
        its expert, which computes only the new positions (O(t) per row, like the compute).
        1. Append the new positions' LayerNorm(z2) to the cache.
        2. Rows: deterministic, one per (channel, sequence), positions 0..t-1; partial, one per
           (sequence, channel), positions P..t-1, routed once when the prefix is complete (the
           decision is cached); before that the rank sends no rows (positions < P: gate 1).
        3. All-gather every rank's span [lo, hi) of wanted row positions (ranks may be at
           different positions); pad the rows to the widest hi.
        4. Dispatch, run the experts on their spans, combine; every rank joins every exchange.
        """
        cfg = self.cfg
        B, k, _ = z_BkF.shape
        t = start + k
        P = cfg.prefix_len
        z1, z2 = z_BkF.chunk(2, dim=-1) if cfg.split else (z_BkF, z_BkF)
        v_BtC = cache_append(state, "v", self.norm(z2), start, limit=cfg.seq_len)
        C = v_BtC.shape[-1]
        deterministic = self.routing.router_reads == "none"
        weight_S = None
        if deterministic:
            rows_SM = v_BtC.permute(2, 0, 1).reshape(C * B, t)
            expert_S, lo, hi = self.channel_expert_C.repeat_interleave(B), start, t
        elif t <= P:
            rows_SM = v_BtC.new_zeros(0, 0)
            expert_S, lo, hi = self.channel_expert_C.new_zeros(0), 0, 0
        else:
            if "expert_BC" not in state:  # the routing prefix is complete: route once, per row
                prefix_SP = v_BtC[:, :P, :].transpose(1, 2).reshape(B * C, P)
                with record_function(RANGES["routing"]):
                    plan = self.routing.route(router_logits(prefix_SP, self.router), training=False,
                                              layer=self.layer_name)
                state["expert_BC"] = plan.experts_SK[:, 0].reshape(B, C)
                state["weight_BC"] = plan.weights_SK[:, 0].to(z_BkF.dtype).reshape(B, C)
            rows_SM = v_BtC[:, P:, :].transpose(1, 2).reshape(B * C, t - P)
            expert_S, weight_S = state["expert_BC"].reshape(-1), state["weight_BC"].reshape(-1)
            lo, hi = max(start - P, 0), t - P
        if rows_SM.shape[0] == 0:  # nothing wanted from here (an empty batch): no span
            lo = hi = 0
        mark = self.dispatcher.timer.mark()
        spans_W = self.dispatcher.gather_spans(lo, hi)
        width = max(h for _, h in spans_W)
        if rows_SM.shape[1] != width:  # another rank is further on: zeros after hi never reach outputs <= hi
            rows_SM = F.pad(rows_SM[:, :hi], (0, width - hi))
        x_RM, counts_L, dstate = self.dispatcher.dispatch(rows_SM, expert_S, presorted=deterministic)
        with record_function(RANGES["token_mixing"]):
            y_RK = self.experts.step(x_RM, self.dispatcher.received_counts(dstate, counts_L), spans_W)
        y_Sk = self.dispatcher.combine(y_RK, dstate)[:, :hi - lo]
        self.comm_time = self.dispatcher.timer.take(mark)
        if weight_S is not None:
            y_Sk = y_Sk * weight_S[:, None]
        m = hi - lo  # rows: gate minus one, as in forward; the last m of the k new positions are predicted
        if deterministic:
            dev_BmC = y_Sk.reshape(C, B, m).permute(1, 2, 0)
        else:
            dev_BmC = y_Sk.reshape(B, C, m).transpose(1, 2)
        z1_pred = z1[:, k - m:]
        z1_BmC = z1_pred if weight_S is None else z1_pred * weight_S.reshape(B, 1, C)
        out_BmC = z1_BmC + z1_pred * dev_BmC
        return torch.cat([z1[:, :k - m], out_BmC], dim=1) if m < k else out_BmC  # positions < P: gate 1


class SparseBlock(nn.Module):
    """sMLP sparse block (Fig. 2): sMoE token mixing, then Base Layers tMoE; no dense projections."""

    def __init__(self, cfg: SparseBlockConfig, dispatcher=None):
        super().__init__()
        self.cfg = cfg
        self.norm = nn.LayerNorm(cfg.d_model)
        self.smoe = SMoE(cfg.smoe, dispatcher)
        self.tmoe = TMoE(cfg.tmoe, self.smoe.dispatcher)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BND: Tensor) -> Tensor:
        x_BND = x_BND + self.dropout(self.smoe(self.norm(x_BND)))
        y_SD = self.tmoe(x_BND.reshape(-1, self.cfg.d_model))
        return x_BND + self.dropout(y_SD.view_as(x_BND))

    def step(self, x_BkD: Tensor, state: dict, start: int) -> Tensor:
        """Cached decoding of positions start..start+k-1 (eval mode): the tMoE routes the new tokens alone."""
        x_BkD = x_BkD + self.smoe.step(self.norm(x_BkD), state, start)
        return x_BkD + self.tmoe(x_BkD.reshape(-1, self.cfg.d_model)).view_as(x_BkD)
