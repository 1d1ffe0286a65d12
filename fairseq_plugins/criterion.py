"""The LM criterion for every model here: cross-entropy plus the weighted auxiliary loss.

Logged separately: `loss`/`nll_loss`/`ppl` are the language-model figures only (comparable with
fairseq's cross_entropy), `aux_loss` the load-balancing term per token, `z_loss` the routers'
z-loss (ST-MoE, Switch and GShard; added to the loss with --router-z-loss-weight, 0 by default as
in the sMLP paper). Partial prediction (sMLP 3.2.2) scores only positions after the routing
prefix.

Balanced routers (Base Layers, sMLP's tMoE, sMLP-partial's sMoE) evaluate with their model's
--balanced-eval-routing (priced by default: smlp/routing/prices.py). Two diagnostics, each a second
forward (models without such a router log their own loss there):
--valid-trained-routing logs `trained_routing_loss` / `trained_routing_ppl`, the same targets with every
balanced router assigning as in training, with exact balance over the batch (not causal: a token's
expert depends on the rest of the batch); --valid-greedy-routing logs `greedy_routing_loss` /
`greedy_routing_ppl`, every balanced router routing greedily (fairseq's BaseLayer), with that
forward's loads (`load_greedy_<i>_<kind>`, ...).

Validation with --valid-suffix-from N also logs `suffix_loss` / `suffix_ppl`: the same figures over
the target positions >= N only, so that every model can be scored on the positions sMLP-partial
predicts (N = its routing prefix, 0.2 T): the positions with the least context have the highest
loss, and a perplexity that leaves them out is not comparable with one that counts them.

Routing, per MoE module (`<i>_<kind>`: layer index and module), over every rank and micro-batch
of the update: the tokens (rows) each expert computed are summed, not ratios averaged, so the
figures describe the whole layer:
    load_<i>_<kind>       the busiest expert's load over the mean (1.0 = balanced)
    load_min_<i>_<kind>   the least loaded expert's over the mean
    load_cv_<i>_<kind>    coefficient of variation of the per-expert load (std / mean, 0 = balanced)
    idle_<i>_<kind>       experts that received no token
    drop_<i>_<kind>       Switch, GShard: the fraction of routing slots (token, choice) dropped over
                          capacity (Switch: of the tokens; GShard: of its 2 slots per token)
and with --log-a2a-time `a2a_ms_<i>_<kind>`, the forward all2all time in milliseconds.

No host sync: the forward reads nothing from the device. The token count comes from the batch
(fairseq's `ntokens`, counted by the collater on the host; with partial prediction, minus the
prefix positions when nothing is padded, else counted on the device and read once), and the
logged values stay tensors: fairseq sums logging outputs as they are (one process: Python sums of
tensors, read when the meters print; several: `all_reduce_dict` packs numbers and tensors into
device buffers, all-reduces them and hands back tensors), so they are read once per step by
fairseq's logging rather than once per layer here. The all2all time, when asked for, is read here
from timing events recorded during the forward (smlp/dispatch.py), after it.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.dataclass import FairseqDataclass
from fairseq.logging import metrics
from omegaconf import II


@dataclass
class SMLPLossConfig(FairseqDataclass):
    aux_loss_weight: float = field(
        default=0.01, metadata={"help": "weight of the routers' auxiliary load-balancing loss (Switch: 0.01)"}
    )
    router_z_loss_weight: float = field(
        default=0.0, metadata={"help": "weight of the router z-loss (ST-MoE, Zoph et al. 2022: mean over tokens of "
                                       "logsumexp(router logits)^2) of the Switch and GShard routers; ST-MoE uses "
                                       "0.001; 0 (default, the sMLP paper's setting) adds nothing"})
    log_a2a_time: bool = field(
        default=False,
        metadata={"help": "log the forward all2all time of every MoE module (a2a_ms_*), measured with device "
                          "timing events (wall clock on the CPU); off, nothing is timed"},
    )
    valid_suffix_from: int = field(
        default=0,
        metadata={"help": "in validation, also log suffix_loss / suffix_ppl over the target positions >= N only "
                          "(e.g. sMLP-partial's routing prefix, 0.2 x --tokens-per-sample, to score every model on "
                          "the positions partial prediction predicts); 0 (default) logs nothing more"},
    )
    valid_trained_routing: bool = field(
        default=False,
        metadata={"help": "in validation, also log trained_routing_loss / trained_routing_ppl: the loss with every "
                          "balanced router (Base Layers, sMLP's tMoE, sMLP-partial's sMoE) assigning as in training "
                          "(exact balance over the batch) instead of greedily; models without one log their own loss "
                          "there"},
    )
    valid_greedy_routing: bool = field(
        default=False,
        metadata={"help": "in validation, also log greedy_routing_loss / greedy_routing_ppl and the loads "
                          "(load_greedy_*): every balanced router routing greedily (argmax of its scores, fairseq's "
                          "BaseLayer) instead of by its --balanced-eval-routing; models without one log their own "
                          "loss there"},
    )
    sentence_avg: bool = II("optimization.sentence_avg")


def moe_stats(core, *, a2a_time: bool = False) -> dict:
    """The routing counts of every MoE module after a forward, as device tensors (no host read):
    `moe_load_<key>` the rows each expert computed (E,), and for the routers with a capacity
    `moe_drop_<key>` the slots dropped and `moe_slots_<key>` the slots routed; with a2a_time the
    all2all time. fairseq sums logging outputs over micro-batches and ranks (one all-reduce of
    tensors, vectors included), so `reduce_metrics` derives the figures from counts summed over
    the whole update. Every rank logs the same keys (a module that routed nothing logs zeros)."""
    stats = {}
    for name, module in core.moe_modules():
        load = getattr(module, "load_E", None)
        if load is None:
            continue
        parts = name.split(".")
        key = f"{parts[1]}_{parts[-1]}" if len(parts) > 2 else name.replace(".", "_")
        stats[f"moe_load_{key}"] = load.double()
        dropped = getattr(module, "dropped", None)
        if dropped is not None:
            stats[f"moe_drop_{key}"] = dropped.double()
            stats[f"moe_slots_{key}"] = module.slots
        if a2a_time:
            stats[f"a2a_ms_{key}"] = 1000.0 * float(getattr(module, "comm_seconds", 0.0))
    return stats


def routing_figures(load_E, dropped=None, slots=None) -> dict:
    """The logged figures of one layer from its per-expert load summed over ranks (tensor ops: read
    when fairseq's meters print): load, load_min, load_cv (over the mean load), idle, and drop."""
    load_E = torch.as_tensor(load_E, dtype=torch.float64)
    mean = load_E.mean()
    safe = torch.where(mean > 0, mean, torch.ones_like(mean))  # nothing routed: every figure 0
    out = {"load": load_E.max() / safe, "load_min": load_E.min() / safe,
           "load_cv": load_E.std(unbiased=False) / safe, "idle": (load_E == 0).sum().double()}
    if dropped is not None:  # no float(): the sums may be device tensors (fairseq's all-reduce)
        slots_f64 = torch.as_tensor(slots, dtype=torch.float64).clamp(min=1)
        out["drop"] = torch.as_tensor(dropped, dtype=torch.float64) / slots_f64
    return out


def predicted_tokens(sample, target, start: int, pad: int) -> int:
    """Non-padding targets of `target` (its first `start` positions already set to padding),
    without reading the device when the batch tells.

    fairseq's collater counts the targets on the host (`ntokens`, every non-padding target before
    the prefix was masked); the routing prefix removes start of them from every sequence when no
    sequence is padded."""
    ntokens = sample.get("ntokens")
    if isinstance(ntokens, int):
        if not start:
            return ntokens
        if ntokens == target.numel():  # no padding anywhere: every sequence loses start targets
            return ntokens - target.size(0) * start
    return int((target != pad).sum())  # one host read


@register_criterion("smlp_lm_loss", dataclass=SMLPLossConfig)
class SMLPLanguageModelLoss(FairseqCriterion):
    def __init__(self, task, aux_loss_weight, sentence_avg, log_a2a_time=False, router_z_loss_weight=0.0,
                 valid_suffix_from=0, valid_trained_routing=False, valid_greedy_routing=False):
        super().__init__(task)
        self.valid_greedy_routing = valid_greedy_routing
        self.valid_trained_routing = valid_trained_routing
        if valid_suffix_from < 0:
            raise ValueError(f"--valid-suffix-from {valid_suffix_from} is invalid: a target position >= 0")
        self.valid_suffix_from = valid_suffix_from
        self.aux_loss_weight = aux_loss_weight
        self.router_z_loss_weight = router_z_loss_weight
        self.sentence_avg = sentence_avg
        self.log_a2a_time = log_a2a_time

    def forward(self, model, sample, reduce=True):
        core = model.decoder.core
        if self.log_a2a_time and getattr(core, "dispatcher", None) is not None:
            core.dispatcher.timer.enabled = True  # timing is the logs' request, made before the forward
        if "net_input" not in sample:
            return self._empty_batch(model, core)
        net_output = model(**sample["net_input"])
        lprobs = model.get_normalized_probs(net_output, log_probs=True)
        target = model.get_targets(sample, net_output)
        start = core.cfg.prediction_start
        if start:  # positions in the routing prefix are not predicted (partial prediction)
            target = target.clone()
            target[:, :start] = self.padding_idx
        ntokens = predicted_tokens(sample, target, start, self.padding_idx)
        nll = F.nll_loss(lprobs.view(-1, lprobs.size(-1)), target.reshape(-1), ignore_index=self.padding_idx,
                         reduction="sum" if reduce else "none")
        sample_size = sample["target"].size(0) if self.sentence_avg else ntokens
        aux = core.aux_loss()
        z = core.z_loss() if hasattr(core, "z_loss") else None
        loss = nll
        # the trainer divides by sample_size: scale so each router term enters once per token
        if aux is not None and self.aux_loss_weight:
            loss = loss + self.aux_loss_weight * aux * max(sample_size, 1)
        if z is not None and self.router_z_loss_weight:
            loss = loss + self.router_z_loss_weight * z * max(sample_size, 1)
        logging_output = {
            "loss": nll.data,
            "aux_loss": aux.detach() if aux is not None else 0.0,
            "ntokens": ntokens,
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
            "moe_count": 1,  # stats below are averaged over the logging outputs summed into one
            **moe_stats(core, a2a_time=self.log_a2a_time),
        }
        if aux is not None:
            logging_output["aux_count"] = 1  # logged only by models with an auxiliary loss
        if z is not None:
            logging_output["z_loss"] = z.detach()
        if self.valid_suffix_from and not model.training:
            suffix_from = max(self.valid_suffix_from, start)
            suffix = target.clone()
            suffix[:, :suffix_from] = self.padding_idx
            logging_output["suffix_loss"] = F.nll_loss(lprobs.view(-1, lprobs.size(-1)), suffix.reshape(-1),
                                                       ignore_index=self.padding_idx, reduction="sum").data
            logging_output["suffix_ntokens"] = predicted_tokens(sample, suffix, suffix_from, self.padding_idx)
        if self.valid_trained_routing and not model.training:
            logging_output["trained_routing_loss"], _ = self._rerouted_nll(
                model, core, sample, target, nll, core.assigning_as_in_training)
            logging_output["trained_routing_ntokens"] = ntokens
        if self.valid_greedy_routing and not model.training:
            logging_output["greedy_routing_loss"], stats = self._rerouted_nll(
                model, core, sample, target, nll, core.routing_greedily)
            logging_output["greedy_routing_ntokens"] = ntokens
            # moe_<figure>_<layer> -> moe_<figure>_greedy_<layer>: logged as load_greedy_<layer>, ...
            logging_output.update({"moe_{}_greedy_{}".format(*k[len("moe_"):].split("_", 1)): v
                                   for k, v in stats.items() if k.startswith("moe_")})
        return loss, sample_size, logging_output

    def _empty_batch(self, model, core):
        """A batch without sequences: fairseq-validate (and fairseq-eval-lm) shard the batches over the ranks
        and hand a rank whose shard is shorter an empty sample ({}, fairseq's ShardedIterator fill). An
        expert-parallel model still runs a forward of no sequence, so that this rank takes part in every
        expert exchange its peers make (they would wait for it in the all2all otherwise), and logs nothing:
        no tokens, no loss, no routing counts beyond the zeros the forward routed."""
        device = next(model.parameters()).device
        tokens = torch.zeros((0, 1), dtype=torch.long, device=device)
        net_output = model(src_tokens=tokens, src_lengths=tokens.new_zeros(0))
        loss = net_output[0].float().sum()  # 0, on the device
        logging_output = {"loss": loss.data, "aux_loss": 0.0, "ntokens": 0, "nsentences": 0, "sample_size": 0,
                          "moe_count": 0, **moe_stats(core, a2a_time=self.log_a2a_time)}
        return loss, 0, logging_output

    def _rerouted_nll(self, model, core, sample, target, nll, routing):
        """The summed nll of the same targets with the balanced routers routing as `routing()` says (a second
        forward, only for models that have one: the others' routing does not change), and its routing counts."""
        if not core.has_balanced_routers:
            return nll.sum().data, {}
        with routing():
            lprobs = model.get_normalized_probs(model(**sample["net_input"]), log_probs=True)
        return F.nll_loss(lprobs.view(-1, lprobs.size(-1)), target.reshape(-1), ignore_index=self.padding_idx,
                          reduction="sum").data, moe_stats(core)

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        loss_sum = sum(log.get("loss", 0) for log in logging_outputs)
        ntokens = sum(log.get("ntokens", 0) for log in logging_outputs)
        sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
        metrics.log_scalar("loss", loss_sum / max(sample_size, 1) / math.log(2), sample_size, round=3)
        metrics.log_scalar("nll_loss", loss_sum / max(ntokens, 1) / math.log(2), ntokens, round=3)
        metrics.log_derived("ppl", lambda meters: utils.get_perplexity(meters["nll_loss"].avg))
        if any("suffix_ntokens" in log for log in logging_outputs):
            suffix_tokens = sum(log.get("suffix_ntokens", 0) for log in logging_outputs)
            suffix_sum = sum(log.get("suffix_loss", 0) for log in logging_outputs)
            metrics.log_scalar("suffix_loss", suffix_sum / max(suffix_tokens, 1) / math.log(2), suffix_tokens,
                               round=3)
            metrics.log_derived("suffix_ppl", lambda meters: utils.get_perplexity(meters["suffix_loss"].avg))
        for routing in ("trained_routing", "greedy_routing"):
            if any(f"{routing}_ntokens" in log for log in logging_outputs):
                routed_tokens = sum(log.get(f"{routing}_ntokens", 0) for log in logging_outputs)
                routed_sum = sum(log.get(f"{routing}_loss", 0) for log in logging_outputs)
                metrics.log_scalar(f"{routing}_loss", routed_sum / max(routed_tokens, 1) / math.log(2),
                                   routed_tokens, round=3)
                metrics.log_derived(f"{routing}_ppl",
                                    lambda meters, r=routing: utils.get_perplexity(meters[f"{r}_loss"].avg))
        count = max(sum(log.get("moe_count", 0) for log in logging_outputs), 1)
        # which models have an auxiliary loss is in the keys (no host read of the values)
        if any("aux_count" in log for log in logging_outputs):
            aux = sum(log.get("aux_loss", 0.0) for log in logging_outputs)
            metrics.log_scalar("aux_loss", aux / count, round=4)
        if any("z_loss" in log for log in logging_outputs):
            metrics.log_scalar("z_loss", sum(log.get("z_loss", 0.0) for log in logging_outputs) / count, round=4)
        keys = sorted({k for log in logging_outputs for k in log})
        for k in keys:
            if k.startswith("a2a_ms_"):
                metrics.log_scalar(k, sum(log.get(k, 0.0) for log in logging_outputs) / count, round=3)
            if not k.startswith("moe_load_"):
                continue
            layer = k[len("moe_load_"):]
            summed = {name: sum(log[f"moe_{name}_{layer}"] for log in logging_outputs if f"moe_{name}_{layer}" in log)
                      for name in ("load", "drop", "slots") if f"moe_{name}_{layer}" in keys}
            figures = routing_figures(summed["load"], summed.get("drop"), summed.get("slots"))
            for name, value in figures.items():
                metrics.log_scalar(f"{name}_{layer}", value, round=4 if name == "drop" else 3)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        # summed with one all-reduce; fairseq's list all-gather needs CUDA (torch.cuda.ByteTensor)
        return True
