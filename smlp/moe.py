"""MoE layers as four named stages: route -> dispatch -> experts -> combine (Megatron-Core's MoELayer).

tMoE (token-routed FFN experts, sMLP sections 2.2 and 3.1), sMoE (hidden-dimension-routed spatial experts,
sections 3.1-3.2) and the sMLP sparse block that stacks them. Each layer's `forward` lists its stages; the
sMoE's cached decoding `step` runs the same stages and differs only where decoding differs.

Shapes: the core's legend (smlp/__init__.py); here S rows routed on this rank, K slots per row, R rows a
rank's experts receive, P routing-prefix positions, M = n - P positions the sMoE experts mix (m of them in a
decoding step), k new positions.

Auxiliary losses and loads stay on the module after each forward (`aux_loss`, `z_loss`, `load_E`,
`dropped`) for the criterion to read; a forward reads nothing on the host but its dispatches' split sizes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function

from .config import SMoEConfig, SparseBlockConfig, TMoEConfig
from .decoding_cache import cache_append
from .dispatch import DispatchState, LocalDispatcher
from .experts import FFNExperts, SpatialExperts
from .profiling import RANGES
from .recompute import recomputed
from .routing.gates import router_z_loss
from .routing.logits import router_logits
from .routing.plan import FLAG_ONLY, RoutingPlan, count_rows
from .routing.prices import RouterPrices
from .routing.registry import SMOE_ROUTINGS, TOKEN_ROUTERS
from .routing.token_routers import hash_table
from .spatial import causal_product, check_length

__all__ = ["TMoE", "SMoE", "SparseBlock", "SMoERows", "TokenSlots", "hash_table", "LEAKY_ROUTING_WARNING"]

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
            at inference each token goes to argmax of its score minus the expert's price,
            averaged over training (routing/prices.py; greedy top-1, fairseq's, with
            eval_routing="greedy"). Only the routing
            scores travel through the shuffle (`_shuffled_assignment`): the assignment needs
            nothing else, so the tokens go from home straight to their expert and back, one
            exchange each way instead of fairseq's two (same assignment, outputs and
            gradients as fairseq's layer; tests/test_distributed.py). Why both: balance
            is what makes Base Layers train without an auxiliary loss, but a balanced
            assignment couples the tokens of a batch (the expert of token t depends on later
            tokens), which a causal LM cannot do when generating; priced routing is per token.
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
        self.token_router = TOKEN_ROUTERS[cfg.router]  # the registry entry: top-k, capacity, balance
        self.router = self.token_router.router_class(cfg, self.dispatcher)  # owns its parameters
        D = cfg.d_model
        self.experts = FFNExperts(self.dispatcher.num_local_experts, D, cfg.d_ffn, activation=cfg.activation,
                                  norm=cfg.uses_expert_norm, zero_output=cfg.uses_zero_init_output,
                                  first_expert=self.dispatcher.first_expert)
        self.aux_loss: Tensor | None = None
        self.load_E: Tensor | None = None  # rows each expert computed (kept slots), on the device
        self.dropped: Tensor | None = None  # slots over capacity (Switch, GShard), on the device
        self.slots = 0  # routing slots of the last forward (tokens x choices): the denominator of `dropped`
        self.comm_time = None  # the dispatcher's timed sections of the last forward (CommTime)
        self.layer_name = f"TMoE ({cfg.router} router)"  # LanguageModel sets the module path, for errors
        # set with the balanced router's (LanguageModel.assigning_as_in_training): fixed counts per expert
        self.assign_as_in_training = False
        self.recompute = False  # activation checkpointing: the experts again in backward (recompute.py)

    @property
    def comm_seconds(self) -> float:
        """All2all time of the last forward (0 unless the dispatcher's timer is enabled)."""
        return self.comm_time.seconds if self.comm_time is not None else 0.0

    @property
    def logits_SE(self) -> Tensor | None:
        """The softmax gates' logits of the last forward (Switch, GShard; None otherwise)."""
        return getattr(self.router, "logits_SE", None)

    @property
    def z_loss(self) -> Tensor | None:
        """The router z-loss (ST-MoE) of the last forward's logits (Switch, GShard; None otherwise),
        computed when asked: a forward whose criterion does not ask builds none of its graph."""
        return router_z_loss(self.logits_SE) if self.logits_SE is not None else None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # checkpoints written before the router was a module hold its tensors under the layer's own names
        for old in ("centroids", "gate.weight", "hash_table", "eval_prices.price_E", "eval_prices.price_weight",
                    "eval_prices.pending_E1"):
            if prefix + old in state_dict and prefix + "router." + old not in state_dict:
                state_dict[prefix + "router." + old] = state_dict.pop(prefix + old)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def route(self, x_SD: Tensor, token_ids_S: Tensor | None = None, *,
              defer_checks: bool | str = False) -> RoutingPlan:
        """Stage 1: the routing plan of the rows (the registry's route function: the router logits in
        fp32, routing/logits.py, then the rule). defer_checks leaves the router's input check in the
        plan (read by the dispatcher) instead of reading it here; FLAG_ONLY, its verdict alone (routing/plan.py).

        Returns:
            RoutingPlan: experts_SK (S, K) expert per slot (-1: dropped), weights_SK (S, K) combine
            weights, aux_loss (scalar or None), fault (the deferred check or None)
        """
        return self.router(x_SD, token_ids_S, layer=self.layer_name, defer_checks=defer_checks)

    def forward(self, x_SD: Tensor, token_ids_S: Tensor | None = None) -> Tensor:
        """The expert branch of every row; the caller adds the residual. Cached decoding calls it too
        (on the new rows only): in eval mode every row is routed on its own.

        1. route     (`route`) the plan: expert and combine weight per (row, slot); the auxiliary
                     loss is kept on the module
        2. dispatch  (`dispatch`) every (row, slot) to the rank of its expert; rows and slots per
                     expert are counted on the device (load_E, dropped), dropped slots cut off there
        3. experts   (`run_experts`) the FFN experts on the rows they received
        4. combine   (`combine`) the results back home in their order, weighted, summed per row

        Args:
            x_SD: (S, D) the rows (tokens)
            token_ids_S: (S,) their token ids (the HASH router reads them), or None

        Returns:
            y_SD: (S, D) sum over the row's slots of weight x expert(row); 0 for a dropped slot
        """
        if x_SD.dim() != 2 or x_SD.shape[-1] != self.cfg.d_model:
            raise ValueError(f"TMoE expects rows of shape (S, {self.cfg.d_model}), got {tuple(x_SD.shape)}")
        mark = self.dispatcher.timer.mark()  # Base Layers' shuffle (in route) is timed too
        with record_function(RANGES["routing"]):
            plan = self.route(x_SD, token_ids_S, defer_checks=True)
        self.aux_loss = plan.aux_loss
        if self.dispatcher.chunks > 1:  # the exchanges overlapped with the experts (`pipelined`)
            y_SD = self.pipelined(x_SD, plan)
        else:
            x_RD, counts_L, slots = self.dispatch(x_SD, plan)
            y_RD = self.run_experts(x_RD, counts_L, slots.state)
            y_SD = self.combine(y_RD, slots, x_SD)
        self.comm_time = self.dispatcher.timer.take(mark)
        return y_SD

    def pipelined(self, x_SD: Tensor, plan: RoutingPlan) -> Tensor:
        """Stages 2-4 with the rows in `dispatcher.chunks` chunks (consecutive slots), each chunk's exchange
        overlapped with another's experts (dispatch.Chunks): the same rows, experts and weights as
        `dispatch`, `run_experts`, `combine`."""
        slots, x_slots, expert_SK = self._slots(x_SD, plan)
        n = self.dispatcher.chunks
        chunks = self.dispatcher.dispatch_chunks(list(zip(x_slots.tensor_split(n), expert_SK.tensor_split(n))),
                                                 fault=plan.fault, layer=self.layer_name)
        for i in range(n):
            chunks.send_back(i, self.run_experts(*chunks.rows(i)))
        return self._weighted_sum(torch.cat(chunks.results()), slots, x_SD)

    def step(self, x_SD: Tensor, token_ids_S: Tensor | None = None) -> Tensor:
        """Cached decoding (eval mode): the expert branch of the new rows, as `forward`.

        With every expert on this rank (one process) and no more (row, slot) pairs than local experts
        (decoding a few sequences), each pair goes straight to its expert's weights: the plan's experts
        are read once (the read a dispatch makes), and nothing is sorted, gathered or exchanged. The
        router's check comes as a bare verdict with them; on a fault the rows are routed again with the
        full check, which raises the router's error. Otherwise (expert parallelism, training, larger
        batches) `forward`."""
        S = x_SD.shape[0]
        L = self.dispatcher.num_local_experts
        if self.training or L != self.cfg.num_experts or S * self.token_router.top_k > L or torch.jit.is_tracing():
            return self(x_SD, token_ids_S)
        plan = self.route(x_SD, token_ids_S, defer_checks=FLAG_ONLY)  # no profiler range: decoding is not profiled
        self.aux_loss, self.load_E, self.comm_time = plan.aux_loss, None, None  # load is counted by `forward` only
        S, K = plan.experts_SK.shape
        expert_SK, weight_SK = plan.experts_SK, plan.weights_SK
        if plan.fault is None:
            host = expert_SK.view(-1).tolist()  # the one host read
        else:
            host = torch.cat([expert_SK.view(-1), plan.fault.to(expert_SK.device)]).tolist()
            if host[S * K]:  # the check failed: read in full, it raises the router's error
                self.route(x_SD, token_ids_S)
        if weight_SK.dtype != x_SD.dtype:
            weight_SK = weight_SK.to(x_SD.dtype)
        if S * K == 1:  # one token, one slot: batch-1 decoding
            return self.experts.expert_rows(x_SD, host[0]) * weight_SK if host[0] >= 0 else torch.zeros_like(x_SD)
        y_SD = torch.zeros_like(x_SD)
        for i, e in enumerate(host[:S * K]):
            if e >= 0:  # a dropped slot (over an evaluation capacity) contributes nothing
                s, slot = divmod(i, K)
                y_SD[s:s + 1] += self.experts.expert_rows(x_SD[s:s + 1], e) * weight_SK[s:s + 1, slot:slot + 1]
        return y_SD

    def dispatch(self, x_SD: Tensor, plan: RoutingPlan) -> tuple[Tensor, list[int], TokenSlots]:
        """Stage 2: every (row, slot) to its expert. Dropped slots (expert -1) are dispatched too: the
        dispatcher sorts them first and cuts them off with the counts it reads anyway, where a boolean
        mask here would read the number kept on the host. Their weight is 0 and they combine as zeros.

        Returns:
            x_RD:     (R, D) the rows this rank's experts compute, grouped by local expert
            counts_L: rows per local expert (host ints)
            slots:    what `combine` needs (the dispatcher's state, each slot's row and weight)
        """
        slots, x_slots, expert_SK = self._slots(x_SD, plan)
        x_RD, counts_L, slots.state = self.dispatcher.dispatch(x_slots, expert_SK, counts_E1=slots.counts_E1,
                                                               fault=plan.fault, layer=self.layer_name,
                                                               assigned=plan.dispatch_counts)
        return x_RD, counts_L, slots

    def _slots(self, x_SD: Tensor, plan: RoutingPlan) -> tuple[TokenSlots, Tensor, Tensor]:
        """(TokenSlots without a dispatch state yet, the rows of the S * K slots, their experts); the slots
        are counted per expert on the device (load_E, dropped), or taken from the plan's dispatch_counts
        (the ranks that assigned them counted them; nothing dropped)."""
        S, K = plan.experts_SK.shape
        expert_SK = plan.experts_SK.reshape(-1)  # flattened (S * K,), slot-major per row
        if plan.dispatch_counts is not None and not self.token_router.drops:
            counts_E1 = None
            self.load_E = plan.dispatch_counts[:self.cfg.num_experts]
        else:
            counts_E1 = count_rows(expert_SK, self.cfg.num_experts)
            self.load_E = counts_E1[1:].detach()
        self.dropped, self.slots = (counts_E1[0].detach(), S * K) if self.token_router.drops else (None, 0)
        row_SK = torch.arange(S, device=x_SD.device).repeat_interleave(K) if K > 1 else None
        slots = TokenSlots(None, row_SK, plan.weights_SK.reshape(-1).to(x_SD.dtype), counts_E1)
        return slots, (x_SD if row_SK is None else x_SD[row_SK]), expert_SK

    def run_experts(self, x_RD: Tensor, counts_L: list[int], dstate: DispatchState | None = None) -> Tensor:
        """Stage 3: the FFN experts on the rows they received, (R, D). The counts are fixed by the shapes
        only for a balanced assignment (evaluating as in training): otherwise evaluation computes the
        rows in tiles, so that a row's result does not depend on the other rows (FFNExperts)."""
        fixed = self.token_router.balanced and self.assign_as_in_training
        counts_dev_L = dstate.counts_dev_L if dstate is not None else None

        def experts(x_RD: Tensor) -> Tensor:
            return self.experts(x_RD, counts_L, counts_dev_L=counts_dev_L, fixed_counts=fixed)

        with record_function(RANGES["experts"]):
            return recomputed(self.recompute, experts, x_RD)

    def combine(self, y_RD: Tensor, slots: TokenSlots, x_SD: Tensor) -> Tensor:
        """Stage 4: the results back home, weighted, each row's slots summed.

        Returns:
            y_SD: (S, D), the rows in `x_SD`'s order
        """
        return self._weighted_sum(self.dispatcher.combine(y_RD, slots.state), slots, x_SD)

    @staticmethod
    def _weighted_sum(y_SKD: Tensor, slots: TokenSlots, x_SD: Tensor) -> Tensor:
        """The slots' results (home, in slot order) weighted and summed per row, (S, D)."""
        y_SKD = y_SKD * slots.weight_SK[:, None]
        if slots.row_SK is None:  # one slot per row: the slots are the rows, in order
            return y_SKD
        return torch.zeros_like(x_SD).index_add(0, slots.row_SK, y_SKD)


@dataclass
class TokenSlots:
    """What the tMoE's combine needs of its dispatch: the dispatcher's state, and per (row, slot),
    flattened to S * K, the slot's row (None: one slot per row) and its combine weight; the slots
    counted per expert (`count_rows`)."""

    state: DispatchState | None
    row_SK: Tensor | None
    weight_SK: Tensor
    counts_E1: Tensor | None = None


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
                                      first_expert=self.dispatcher.first_expert,
                                      replicated=getattr(self.dispatcher, "replicated", False))
        self.routing = routing = SMOE_ROUTINGS[cfg.routing]  # the registry entry (routing/registry.py)
        if routing.router_reads != "none":
            P = cfg.router_len
            self.router = nn.Parameter(torch.randn(P, cfg.num_experts) * P ** -0.5)
        if routing.balanced:  # the prices evaluation routes with (smlp/routing/prices.py)
            self.eval_prices = RouterPrices(cfg.num_experts, cfg.eval_routing)
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
        self.assign_as_in_training = False  # as TMoE's
        self._constant_counts: dict = {}  # (share, device) -> the deterministic routing's counts (`_share_counts`)

    @property
    def comm_seconds(self) -> float:
        """All2all time of the last forward (0 unless the dispatcher's timer is enabled)."""
        return self.comm_time.seconds if self.comm_time is not None else 0.0

    @property
    def deterministic(self) -> bool:
        """Hidden chunk i -> expert i: no router (sMLP sec. 3.2.1)."""
        return self.routing.router_reads == "none"

    def forward(self, z_BNF: Tensor) -> Tensor:
        """out = z1 * gate over positions, each hidden dimension's gate computed by its expert.

        1. route     (`route`) LayerNorm(z2) as rows, one per (sequence, hidden dimension), over the
                     positions the experts mix; their experts and weights (a router reads the
                     prefix: partial; chunks: deterministic)
        2. dispatch  (`dispatch`) the rows to their experts' ranks, padded to the widest rank's
                     sequence; rows per expert counted on the device (load_E)
        3. experts   (`run_experts`) each expert mixes the positions of its rows (causal)
        4. combine   (`combine`) the rows back home, weighted, turned into the gate of z1;
                     positions before the routing prefix's end keep gate 1

        Args:
            z_BNF: (B, n, F) with n <= T

        Returns:
            (B, n, C): the gated channels
        """
        cfg = self.cfg
        if z_BNF.dim() != 3 or z_BNF.shape[-1] != cfg.dim:
            raise ValueError(f"SMoE expects (batch, length, {cfg.dim}), got {tuple(z_BNF.shape)}")
        n = z_BNF.shape[1]
        check_length(n, cfg.seq_len)
        P = min(cfg.prefix_len, n)  # a sequence no longer than the routing prefix has nothing to predict
        z1_BNC, z2_BNC = z_BNF.chunk(2, dim=-1) if cfg.split else (z_BNF, z_BNF)
        if (self.deterministic and z_BNF.shape[0] == 1 and self.dispatcher.num_local_experts == cfg.num_experts
                and not self.experts.explicit_spatial):  # the FLOP counter's form: the experts' dense product
            return self._mix_in_place(z1_BNC, self.norm(z2_BNC))
        rows = self.route(self.norm(z2_BNC), P, training=self.training or self.assign_as_in_training,
                          dtype=z_BNF.dtype, defer_checks=True)
        mark = self.dispatcher.timer.mark()
        if self.dispatcher.chunks > 1:  # the exchanges overlapped with the experts (`pipelined`)
            out_BNC = self.pipelined(rows, z1_BNC, n - P)
        else:
            x_RM, counts_L, dstate = self.dispatch(rows)
            y_RM = self.run_experts(x_RM, counts_L)
            out_BNC = self.combine(y_RM, dstate, rows, z1_BNC, n - P)
        self.comm_time = self.dispatcher.timer.take(mark)
        return out_BNC

    def _mix_in_place(self, z1_BNC: Tensor, v_BNC: Tensor) -> Tensor:
        """Stages 2-4 of deterministic routing for one sequence with every expert here (one process, or the
        replicated layout): expert i mixes channel chunk i where it lies, as head i of a multi-head SGU
        (gmlp.SpatialProjection), one blocked causal product over the experts (spatial.py), without the rows'
        copy and the gate's permuted view. For B > 1 sequences the rows' layout stays: a chunk of B sequences
        is no strided matrix, so mixing in place takes one product per sequence and block (forward, input and
        weight gradients: 97 + 187 operators against the rows' 30 + 45 at B = 16, D = T = 128, 8 experts),
        where the rows take one product per block for all of them.

        Returns:
            (B, n, C): z1 gated, z1 + z1 * (W_i v + (b_i - 1)) in chunk i
        """
        B, n, C = v_BNC.shape
        E = self.cfg.num_experts
        self.load_E, self.comm_time = self._share_counts(C // E * B, v_BNC.device)[1:], None
        experts = self.experts
        with record_function(RANGES["token_mixing"]):  # the sMoE's experts mix positions
            y_BNEc = causal_product(experts.weight, v_BNC.reshape(B, n, E, C // E))
            dev_BNC = (y_BNEc + experts.bias_offset[:, :n].t()[None, :, :, None]).reshape(B, n, C)
        return z1_BNC + z1_BNC * dev_BNC

    def _share_counts(self, share: int, device: torch.device) -> Tensor:
        """(E + 1,) the deterministic routing's counts: no row routed nowhere, `share` rows per expert. Made
        once per share and device (read-only: the layers hand it out as load_E)."""
        key = (share, device)
        counts_E1 = self._constant_counts.get(key)
        if counts_E1 is None:
            counts_E1 = torch.full((self.cfg.num_experts + 1,), share, dtype=torch.long, device=device)
            counts_E1[0] = 0
            self._constant_counts[key] = counts_E1
        return counts_E1

    def pipelined(self, rows: SMoERows, z1_BNC: Tensor, m: int) -> Tensor:
        """Stages 2-4 with the sequences in `dispatcher.chunks` chunks, each chunk's exchange overlapped with
        another's experts (dispatch.Chunks): every chunk holds rows of every channel, so every expert
        works on every chunk. The same rows, experts and weights as `dispatch`, `run_experts`, `combine`."""
        B, _, C = z1_BNC.shape
        E, M = self.cfg.num_experts, rows.rows_SM.shape[-1]
        self.load_E = self._counts(rows)[1:]
        bounds = [(int(b[0]), int(b[-1]) + 1) if len(b) else (0, 0)
                  for b in torch.arange(B).tensor_split(self.dispatcher.chunks)]
        parts = []
        for b0, b1 in bounds:
            if self.deterministic:  # rows (channel, sequence): this chunk's sequences of every channel
                parts.append(SMoERows(rows.rows_SM.view(C, B, M)[:, b0:b1].reshape(-1, M),
                                      self.channel_expert_C.repeat_interleave(b1 - b0),
                                      host_counts_E=[C // E * (b1 - b0)] * E))
            else:  # rows (sequence, channel): a consecutive range
                parts.append(SMoERows(rows.rows_SM[b0 * C:b1 * C], rows.expert_S[b0 * C:b1 * C],
                                      None if rows.weight_S is None else rows.weight_S[b0 * C:b1 * C]))
        chunks = self.dispatcher.dispatch_chunks([(p.rows_SM, p.expert_S) for p in parts], presorted=self.deterministic,
                                                 host_counts=[p.host_counts_E for p in parts], fault=rows.fault,
                                                 layer=self.layer_name, common_width=True)
        for i in range(len(parts)):
            chunks.send_back(i, self.run_experts(*chunks.rows(i)))
        return torch.cat([self._gate(y_S, p, z1_BNC[b0:b1], m)
                          for y_S, p, (b0, b1) in zip(chunks.results(), parts, bounds)])

    def step(self, z_BkF: Tensor, state: dict, start: int) -> Tensor:
        """Cached decoding of positions start..t-1 (eval routing; smlp/decoding_cache.py): `forward`'s
        stages on the cached rows, where the experts compute only the new positions.

        The normalized rows stay here, at the source rank; every step sends each row's prefix to
        its expert, which computes only the new positions (O(t) per row, like the compute).
        1. route     append the new positions' LayerNorm(z2) to the cache; the rows are positions
                     0..t-1 (deterministic) or P..t-1 (partial), routed once when the routing
                     prefix is complete (the decision is cached; the router's check is deferred to
                     the dispatch, as in `forward`); before that the rank sends no rows (positions
                     < P: gate 1)
        2. dispatch  all-gather every rank's span [lo, hi) of wanted row positions (ranks may be at
                     different positions), pad the rows to the widest hi, dispatch; every rank joins
                     every exchange
        3. experts   each expert computes the spans of its rows only
        4. combine   as `forward`, for the m predicted new positions

        Returns:
            (B, k, C): the gated channels of the k new positions
        """
        cfg = self.cfg
        k = z_BkF.shape[1]
        t = start + k
        P = cfg.prefix_len
        z1_BkC, z2_BkC = z_BkF.chunk(2, dim=-1) if cfg.split else (z_BkF, z_BkF)
        v_BtC = cache_append(state, "v", self.norm(z2_BkC), start, limit=cfg.seq_len)
        if self.deterministic and self.dispatcher.num_local_experts == cfg.num_experts:
            # every expert is here (one process, or the replicated layout): chunk i -> expert i is a
            # multi-head spatial step over the cache in place, as the SGU's; no rows to sort or exchange
            with record_function(RANGES["token_mixing"]):
                return z1_BkC + z1_BkC * self.experts.step_chunks(v_BtC, start)
        if (k == 1 and "expert_BC" in state and start >= P and self.routing.causal
                and self.dispatcher.num_local_experts == cfg.num_experts):
            # partial prediction, every expert here, the routing decided: the new position of row (b, c) is
            # W_e[i, :m] . v[b, P:t, c] with e its expert, read in place, each row's weight row gathered
            with record_function(RANGES["token_mixing"]):
                weight_BC = state["weight_BC"]
                dev_BC = self.experts.step_routed(v_BtC[:, P:t], state["expert_BC"])
                return z1_BkC * weight_BC[:, None] + z1_BkC * (weight_BC * dev_BC)[:, None]
        rows = self.route(v_BtC, P, training=False, dtype=z_BkF.dtype, defer_checks=True, decided=state)
        lo, hi = (start, t) if self.deterministic else (max(start - P, 0), max(t - P, 0))
        if rows.rows_SM.shape[0] == 0:  # nothing wanted from here (an empty batch): no span
            lo = hi = 0
        mark = self.dispatcher.timer.mark()
        spans_W = self.dispatcher.gather_spans(lo, hi)
        x_RM, counts_L, dstate = self.dispatch(rows, hi=hi, width=max(h for _, h in spans_W))
        y_Rk = self.run_experts(x_RM, counts_L, dstate=dstate, spans_W=spans_W)
        out_BkC = self.combine(y_Rk, dstate, rows, z1_BkC, hi - lo)
        self.comm_time = self.dispatcher.timer.take(mark)
        return out_BkC

    def route(self, v_BNC: Tensor, P: int, *, training: bool, dtype: torch.dtype, defer_checks: bool = False,
              decided: dict | None = None) -> SMoERows:
        """Stage 1: the rows over positions P..n-1 (P = 0 without a router), their experts and weights.

        The router's logits are computed from the prefix's positions (partial) or from all n (leaky),
        in fp32 (routing/logits.py), and the registry's rule turns them into a plan (training:
        balanced, eval: each row's most probable expert). `decided` (cached decoding) keeps the
        decision of each row once made, so later steps route nothing.

        Returns:
            SMoERows: rows_SM (S, M), expert_S (S,), weight_S (S,) or None, and what the dispatcher
            reads with the counts (fault, host_counts_E)
        """
        B, n, C = v_BNC.shape
        E = self.cfg.num_experts
        if self.deterministic:
            # rows ordered (channel, sequence): channel chunk i -> expert i, so the rows come sorted
            # by expert and the dispatcher neither sorts nor gathers them, and how many each expert
            # gets is known from the shapes: nothing to route, count or read from the device
            return SMoERows(v_BNC.permute(2, 0, 1).reshape(C * B, n), None, host_counts_E=[C // E * B] * E)
        if n <= P:  # still take part in the exchange (other ranks may have rows), inside the graph:
            # backward runs the matching exchange
            return SMoERows(v_BNC[:, P:, :].reshape(B * C, 0)[:0], self.channel_expert_C.new_zeros(0))
        rows_SM = v_BNC[:, P:, :].transpose(1, 2).reshape(B * C, n - P)  # one row per (sequence, channel)
        if decided is not None and "expert_BC" in decided:
            return SMoERows(rows_SM, decided["expert_BC"].reshape(-1), decided["weight_BC"].reshape(-1))
        with record_function(RANGES["routing"]):
            if self.routing.router_reads == "all":  # Appendix B: every position, the future ones too
                logits_SE = router_logits(rows_SM, self.router[:n])
            else:
                prefix_SP = v_BNC[:, :P, :].transpose(1, 2).reshape(B * C, P)
                logits_SE = router_logits(prefix_SP, self.router)
            plan = self.routing.route(logits_SE, layer=self.layer_name, defer_checks=defer_checks,
                                      expert_S=self.balanced_experts(logits_SE, training))
        rows = SMoERows(rows_SM, plan.experts_SK[:, 0], plan.weights_SK[:, 0].to(dtype), fault=plan.fault)
        if decided is not None:  # the routing prefix is complete: the decision holds for every later step
            decided["expert_BC"], decided["weight_BC"] = rows.expert_S.reshape(B, C), rows.weight_S.reshape(B, C)
        return rows

    def balanced_experts(self, logits_SE: Tensor, training: bool) -> Tensor | None:
        """The rows' experts (S,) under a balanced routing, as RouterPrices.experts decides: the balanced
        assignment when `training`, else argmax(logit - price) (priced) or None (greedy)."""
        return self.eval_prices.experts(logits_SE, assign=training, observe=self.training)

    def dispatch(self, rows: SMoERows, *, hi: int | None = None,
                 width: int | None = None) -> tuple[Tensor, list[int], DispatchState]:
        """Stage 2: the rows to their experts' ranks.

        Ranks may hold sequences of different lengths: the dispatcher pads every rank's rows to the
        widest (zero positions appended at the end never reach earlier outputs: causal). In cached
        decoding the rows are cut at `hi` and padded to the widest rank's span end `width` here.

        Returns:
            x_RM:     (R, width) the rows this rank's experts receive, grouped by local expert
            counts_L: rows per local expert (host ints)
            dstate:   the dispatcher's state, for `combine`
        """
        if width is not None:  # cached decoding: the spans were all-gathered, no counts or checks travel
            rows_SM = rows.rows_SM
            if rows_SM.shape[1] != width:  # another rank is further on: zeros after hi never reach outputs <= hi
                rows_SM = F.pad(rows_SM[:, :hi], (0, width - hi))
            # the router's check travels with the counts, as in `forward`: a fault on one rank reaches every rank
            return self.dispatcher.dispatch(rows_SM, self._row_experts(rows), presorted=self.deterministic,
                                            fault=rows.fault, layer=self.layer_name)
        counts_E1 = self._counts(rows)
        self.load_E = counts_E1[1:]
        return self.dispatcher.dispatch(rows.rows_SM, rows.expert_S, presorted=self.deterministic,
                                        counts_E1=counts_E1, host_counts_E=rows.host_counts_E, fault=rows.fault,
                                        layer=self.layer_name, common_width=True)

    def _counts(self, rows: SMoERows) -> Tensor:
        """(E + 1,) rows routed nowhere, then rows per expert (`count_rows`), on the device; deterministic
        rows' equal shares are made from the shapes, not counted."""
        if rows.expert_S is None:
            return self._share_counts(rows.host_counts_E[0], rows.rows_SM.device)
        return count_rows(rows.expert_S, self.cfg.num_experts)

    def _row_experts(self, rows: SMoERows) -> Tensor:
        """(S,) the expert of each row; deterministic rows, ordered (channel, sequence), carry none."""
        if rows.expert_S is not None:
            return rows.expert_S
        return self.channel_expert_C.repeat_interleave(rows.rows_SM.shape[0] // self.channel_expert_C.shape[0])

    def run_experts(self, x_RM: Tensor, counts_L: list[int], *, dstate: DispatchState | None = None,
                    spans_W: list[tuple[int, int]] | None = None) -> Tensor:
        """Stage 3: each expert mixes the positions of its rows, all of them (R, M), or in cached
        decoding only each source rank's span (R, k)."""
        with record_function(RANGES["token_mixing"]):  # the sMoE's experts mix positions
            if spans_W is None:
                return self.experts(x_RM, counts_L)
            return self.experts.step(x_RM, self.dispatcher.received_counts(dstate, counts_L), spans_W)

    def combine(self, y_RM: Tensor, dstate: DispatchState, rows: SMoERows, z1_BNC: Tensor, m: int) -> Tensor:
        """Stage 4: the rows back home, weighted by p_e (eq. 7), as the gate of the last m positions of z1.

        The experts return the gate minus one, W x + (b - 1) (SpatialExperts); with p the routing
        weight the gate is p (1 + dev), computed as z1 p + z1 (p dev): the spatial term is kept
        apart from the one (half precision). Earlier positions (the routing prefix) keep gate 1.

        Returns:
            (B, n, C): z1 gated
        """
        return self._gate(self.dispatcher.combine(y_RM, dstate), rows, z1_BNC, m)

    def _gate(self, y_SM: Tensor, rows: SMoERows, z1_BNC: Tensor, m: int) -> Tensor:
        """The rows' results (home, in their order) as the gate of the last m positions of z1, (B, n, C)."""
        B, n, C = z1_BNC.shape
        y_Sm = y_SM if m == y_SM.shape[1] else y_SM[:, :m]
        if rows.weight_S is not None:
            y_Sm = y_Sm * rows.weight_S[:, None]
        if self.deterministic:
            dev_BmC = y_Sm.reshape(C, B, m).permute(1, 2, 0)
        else:
            dev_BmC = y_Sm.reshape(B, C, m).transpose(1, 2)
        z1_BmC = z1_BNC if m == n else z1_BNC[:, n - m:]
        gated_BmC = z1_BmC if rows.weight_S is None else z1_BmC * rows.weight_S.reshape(B, 1, C)
        out_BmC = gated_BmC + z1_BmC * dev_BmC
        return torch.cat([z1_BNC[:, :n - m], out_BmC], dim=1) if m < n else out_BmC


@dataclass
class SMoERows:
    """The sMoE's route stage: the rows (hidden-dimension vectors over the positions the experts mix),
    where they go, and what the dispatcher reads with its counts.

    rows_SM:       (S, M) one row per (channel, sequence) (deterministic: sorted by expert) or per
                   (sequence, channel) (routed)
    expert_S:      (S,) the expert of each row, or None (deterministic: sorted by expert, host_counts_E
                   rows each; SMoE._row_experts makes them where a dispatch needs them)
    weight_S:      (S,) its combine weight p_e (eq. 7), or None (deterministic: weight 1)
    fault:       the router's input check left for the dispatcher, or None
    host_counts_E: rows per expert when known on the host from the shapes (deterministic), or None
    """

    rows_SM: Tensor
    expert_S: Tensor | None
    weight_S: Tensor | None = None
    fault: Tensor | None = None
    host_counts_E: list[int] | None = None


class SparseBlock(nn.Module):
    """sMLP sparse block (Fig. 2): sMoE token mixing, then Base Layers tMoE; no dense projections.

    The two layers share `dispatcher` unless `smoe_dispatcher` gives the sMoE its own: a parallel
    layout per layer type (expert_data_parallel.py), e.g. the sMoE's experts replicated on every rank
    (LocalDispatcher(E, replicated=True)) and the tMoE's spread over the expert-parallel group, or another
    expert count (cfg.smoe_experts: `dispatcher.with_experts(N)` unless given).
    """

    def __init__(self, cfg: SparseBlockConfig, dispatcher=None, smoe_dispatcher=None):
        super().__init__()
        self.cfg = cfg
        dispatcher = dispatcher if dispatcher is not None else LocalDispatcher(cfg.num_experts)
        if smoe_dispatcher is None and cfg.smoe_num_experts != cfg.num_experts:
            smoe_dispatcher = dispatcher.with_experts(cfg.smoe_num_experts)  # as LanguageModel does
        self.norm = nn.LayerNorm(cfg.d_model)
        self.smoe = SMoE(cfg.smoe, smoe_dispatcher if smoe_dispatcher is not None else dispatcher)
        self.tmoe = TMoE(cfg.tmoe, dispatcher)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BND: Tensor) -> Tensor:
        x_BND = x_BND + self.dropout(self.smoe(self.norm(x_BND)))
        y_SD = self.tmoe(x_BND.reshape(-1, self.cfg.d_model))
        return x_BND + self.dropout(y_SD.view_as(x_BND))

    def step(self, x_BkD: Tensor, state: dict, start: int) -> Tensor:
        """Cached decoding of positions start..start+k-1 (eval mode): the tMoE routes the new tokens alone."""
        x_BkD = x_BkD + self.smoe.step(self.norm(x_BkD), state, start)
        return x_BkD + self.tmoe.step(x_BkD.reshape(-1, self.cfg.d_model)).view_as(x_BkD)
