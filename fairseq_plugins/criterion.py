"""The LM criterion for every model here: cross-entropy plus the weighted auxiliary loss.

Logged separately: `loss`/`nll_loss`/`ppl` are the language-model figures only (comparable with
fairseq's cross_entropy), `aux_loss` the load-balancing term per token. Partial prediction
(sMLP 3.2.2) scores only positions after the routing prefix. Per MoE module: `load_<i>_<kind>`
is the busiest expert's share relative to a perfectly even split (1.0 = balanced) and
`a2a_ms_<i>_<kind>` the forward all2all time in milliseconds.
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
    sentence_avg: bool = II("optimization.sentence_avg")


def moe_stats(core) -> dict[str, float]:
    """Load imbalance and all2all time of every MoE module after a forward."""
    stats = {}
    for name, module in core.moe_modules():
        load = getattr(module, "load_E", None)
        if load is None or load.sum() == 0:
            continue
        parts = name.split(".")
        key = f"{parts[1]}_{parts[-1]}" if len(parts) > 2 else name.replace(".", "_")
        stats[f"load_{key}"] = float(load.max()) / float(load.float().mean())
        stats[f"a2a_ms_{key}"] = 1000.0 * float(getattr(module, "comm_seconds", 0.0))
    return stats


@register_criterion("smlp_lm_loss", dataclass=SMLPLossConfig)
class SMLPLanguageModelLoss(FairseqCriterion):
    def __init__(self, task, aux_loss_weight, sentence_avg):
        super().__init__(task)
        self.aux_loss_weight = aux_loss_weight
        self.sentence_avg = sentence_avg

    def forward(self, model, sample, reduce=True):
        net_output = model(**sample["net_input"])
        core = model.decoder.core
        lprobs = model.get_normalized_probs(net_output, log_probs=True)
        target = model.get_targets(sample, net_output)
        start = core.cfg.prediction_start
        if start:  # positions in the routing prefix are not predicted (partial prediction)
            target = target.clone()
            target[:, :start] = self.padding_idx
        nll = F.nll_loss(lprobs.view(-1, lprobs.size(-1)), target.reshape(-1), ignore_index=self.padding_idx,
                         reduction="sum" if reduce else "none")
        ntokens = int((target != self.padding_idx).sum())
        sample_size = sample["target"].size(0) if self.sentence_avg else ntokens
        aux = core.aux_loss()
        loss = nll
        if aux is not None and self.aux_loss_weight:
            # the trainer divides by sample_size: scale so the aux term enters once per token
            loss = nll + self.aux_loss_weight * aux * max(sample_size, 1)
        logging_output = {
            "loss": nll.data,
            "aux_loss": float(aux) if aux is not None else 0.0,
            "ntokens": ntokens,
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
            "moe_count": 1,  # stats below are averaged over the logging outputs summed into one
            **moe_stats(core),
        }
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
        aux = sum(log.get("aux_loss", 0.0) for log in logging_outputs)
        if aux:
            metrics.log_scalar("aux_loss", aux / count, round=4)
        keys = sorted({k for log in logging_outputs for k in log if k.startswith(("load_", "a2a_ms_"))})
        for k in keys:
            metrics.log_scalar(k, sum(log.get(k, 0.0) for log in logging_outputs) / count, round=3)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        # summed with one all-reduce; fairseq's list all-gather needs CUDA (torch.cuda.ByteTensor)
        return True
