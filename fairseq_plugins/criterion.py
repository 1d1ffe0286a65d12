"""The LM criterion for every model here: cross-entropy plus the weighted auxiliary loss.

Logged separately: `loss`/`nll_loss`/`ppl` are the language-model figures only (comparable with
fairseq's cross_entropy), `aux_loss` the load-balancing term per token. Partial prediction
(sMLP 3.2.2) scores only positions after the routing prefix. Per MoE module: `load_<i>_<kind>`
is the busiest expert's share relative to a perfectly even split (1.0 = balanced), and with
--log-a2a-time `a2a_ms_<i>_<kind>` the forward all2all time in milliseconds.

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
    log_a2a_time: bool = field(
        default=False,
        metadata={"help": "log the forward all2all time of every MoE module (a2a_ms_*), measured with device "
                          "timing events (wall clock on the CPU); off, nothing is timed"},
    )
    sentence_avg: bool = II("optimization.sentence_avg")


def moe_stats(core, *, a2a_time: bool = False) -> dict:
    """Load imbalance (device tensors, no host read) and, with a2a_time, all2all time of every MoE
    module after a forward. A module that routed no row logs a load of 0 (every rank logs the same
    keys, which fairseq's summed logging outputs need)."""
    stats = {}
    for name, module in core.moe_modules():
        load = getattr(module, "load_E", None)
        if load is None:
            continue
        parts = name.split(".")
        key = f"{parts[1]}_{parts[-1]}" if len(parts) > 2 else name.replace(".", "_")
        ratio = load.max().double() / load.float().mean().double()
        stats[f"load_{key}"] = torch.where(load.sum() > 0, ratio, torch.zeros_like(ratio))
        if a2a_time:
            stats[f"a2a_ms_{key}"] = 1000.0 * float(getattr(module, "comm_seconds", 0.0))
    return stats


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
    def __init__(self, task, aux_loss_weight, sentence_avg, log_a2a_time=False):
        super().__init__(task)
        self.aux_loss_weight = aux_loss_weight
        self.sentence_avg = sentence_avg
        self.log_a2a_time = log_a2a_time

    def forward(self, model, sample, reduce=True):
        core = model.decoder.core
        if self.log_a2a_time and getattr(core, "dispatcher", None) is not None:
            core.dispatcher.timer.enabled = True  # timing is the logs' request, made before the forward
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
        loss = nll
        if aux is not None and self.aux_loss_weight:
            # the trainer divides by sample_size: scale so the aux term enters once per token
            loss = nll + self.aux_loss_weight * aux * max(sample_size, 1)
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
        return loss, sample_size, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        loss_sum = sum(log.get("loss", 0) for log in logging_outputs)
        ntokens = sum(log.get("ntokens", 0) for log in logging_outputs)
        sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
        metrics.log_scalar("loss", loss_sum / max(sample_size, 1) / math.log(2), sample_size, round=3)
        metrics.log_scalar("nll_loss", loss_sum / max(ntokens, 1) / math.log(2), ntokens, round=3)
        metrics.log_derived("ppl", lambda meters: utils.get_perplexity(meters["nll_loss"].avg))
        count = max(sum(log.get("moe_count", 0) for log in logging_outputs), 1)
        # which models have an auxiliary loss is in the keys (no host read of the values)
        if any("aux_count" in log for log in logging_outputs):
            aux = sum(log.get("aux_loss", 0.0) for log in logging_outputs)
            metrics.log_scalar("aux_loss", aux / count, round=4)
        keys = sorted({k for log in logging_outputs for k in log if k.startswith(("load_", "a2a_ms_"))})
        for k in keys:
            metrics.log_scalar(k, sum(log.get(k, 0.0) for log in logging_outputs) / count, round=3)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        # summed with one all-reduce; fairseq's list all-gather needs CUDA (torch.cuda.ByteTensor)
        return True
