"""The tiny model of each family and one training step of it through the fairseq wrapper and criterion, its host
syncs counted on the accelerator's path (tests/test_hot_path.py's budget; tests/test_routing_metrics.py)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from smlp.lm import LanguageModel, LMConfig
from smlp_bench.micro.host_syncs import HostSyncCounter, accelerator_paths

FAMILIES = {
    "sMLP-det": dict(family="smlp", smoe_routing="deterministic"),
    "sMLP-partial": dict(family="smlp", smoe_routing="partial"),
    "Base": dict(family="transformer", moe_router="base"),
    "GShard": dict(family="transformer", moe_router="gshard"),
    "HASH": dict(family="transformer", moe_router="hash"),
    "Switch": dict(family="transformer", moe_router="switch"),
    "gMLP": dict(family="gmlp"),
    "Transformer": dict(family="transformer"),
}
TINY = dict(vocab_size=64, d_model=16, d_ffn=32, seq_len=20, heads=2, num_experts=4, padding_idx=1)
BATCH = 4


def tiny_config(name: str, dense: int = 2, sparse: int = 2) -> LMConfig:
    spec = FAMILIES[name]
    dense_family = spec["family"] == "gmlp" or "moe_router" not in spec and spec["family"] == "transformer"
    return LMConfig(**TINY, **spec, dense_layers=dense if not dense_family else dense + sparse,
                    sparse_layers=0 if dense_family else sparse)


def tokens(batch: int = BATCH, seq_len: int = TINY["seq_len"], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, TINY["vocab_size"], (batch, seq_len), generator=g)


class _Replay(torch.nn.Module):
    """A fairseq language model whose forward returns an output computed before, so that only the
    criterion's own work is counted."""

    def __init__(self, fairseq_model, net_output):
        super().__init__()
        self.inner, self.net_output = fairseq_model, net_output
        self.decoder = fairseq_model.decoder

    def forward(self, **net_input):
        return self.net_output

    def get_normalized_probs(self, net_output, log_probs):
        return self.inner.get_normalized_probs(net_output, log_probs=log_probs)

    def get_targets(self, sample, net_output):
        return self.inner.get_targets(sample, net_output)


def fairseq_model(core: LanguageModel):
    """The fairseq wrapper of `core` with an in-memory dictionary (no data files)."""
    from fairseq.data import Dictionary

    from fairseq_plugins.models import CoreLMDecoder, _CoreLanguageModel

    dictionary = Dictionary()
    for i in range(core.cfg.vocab_size - len(dictionary)):
        dictionary.add_symbol(f"w{i}")
    assert len(dictionary) == core.cfg.vocab_size and dictionary.pad() == core.cfg.padding_idx
    return _CoreLanguageModel(CoreLMDecoder(dictionary, core)), dictionary


def criterion(dictionary, aux_loss_weight: float = 0.01):
    from fairseq_plugins.criterion import SMLPLanguageModelLoss

    return SMLPLanguageModelLoss(SimpleNamespace(target_dictionary=dictionary), aux_loss_weight, False)


def lm_sample(tokens_BN: torch.Tensor, pad: int) -> dict:
    B, N = tokens_BN.shape
    target = torch.roll(tokens_BN, -1, dims=1)
    return {"net_input": {"src_tokens": tokens_BN, "src_lengths": torch.full((B,), N)},
            "target": target, "ntokens": int((target != pad).sum()), "nsentences": B}


def count_step(name: str, seed: int = 0) -> dict:
    """Host syncs of forward, criterion and backward of one training step of the family's tiny model."""
    torch.manual_seed(seed)
    core = LanguageModel(tiny_config(name)).train()
    model, dictionary = fairseq_model(core)
    crit = criterion(dictionary)
    sample = lm_sample(tokens(seed=seed), dictionary.pad())
    out = {}
    with accelerator_paths():
        with HostSyncCounter() as fwd:
            net_output = model(**sample["net_input"])
        with HostSyncCounter() as crit_count:
            loss, _, _ = crit(_Replay(model, net_output), sample)
        with HostSyncCounter() as bwd:
            loss.backward()
    for part, counter in (("forward", fwd), ("criterion", crit_count), ("backward", bwd)):
        out[part] = counter.count
        out[f"{part}_sites"] = dict(counter.by_site)
    out["sparse_layers"] = core.cfg.sparse_layers
    return out


class PlainOpCount(TorchDispatchMode):
    """Operators that reach the kernels (below autograd), counted whole: the reference for the step breakdown's
    per-block counts (smlp_bench.micro.op_count) and the operator-count tests."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.namespace != "profiler"
        return func(*args, **(kwargs or {}))
