"""Host syncs and torch.compile graph breaks of a training step, per model family (issue 19).

    python -m smlp_bench.micro.hot_path [--out results/hot_path.json] [--no-graph-breaks]

One question: how often does a training step stall the host on the device (counted on the code
path CUDA takes, `smlp_bench.micro.host_syncs`), and into how many graphs does torch.compile cut the
model? For every family a tiny model in one process (local dispatch, training mode):

- syncs: host syncs of one forward, its backward and the criterion (`smlp_lm_loss` on the
  forward's output), with 2 dense + 2 sparse layers, and where each came from;
- graph breaks: `torch._dynamo.explain` of the forward of 1 dense + 1 sparse layer (2 dense
  layers for the dense families), training mode, with balanced assignment on the CPU's numpy
  path and on the torch path an accelerator takes.

Writes a JSON record (config, versions, figures) to --out and a table to stdout.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from smlp.lm import LanguageModel, LMConfig

from .harness import environment, parser, write_record
from .host_syncs import HostSyncCounter, accelerator_paths, torch_assignment_path

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


def graph_breaks(name: str, *, accelerator_path: bool = False) -> dict:
    """torch._dynamo.explain of one training forward of 1 dense + 1 sparse layer.

    accelerator_path: balanced assignment on its torch path (what a CUDA run traces) instead of
    numpy (the CPU's)."""
    import contextlib

    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    core = LanguageModel(tiny_config(name, dense=1, sparse=1)).train()
    validate = torch.distributions.Distribution._validate_args
    try:
        with torch_assignment_path() if accelerator_path else contextlib.nullcontext():
            explanation = torch._dynamo.explain(core)(tokens())
    finally:  # dynamo turns off argument validation of torch.distributions for the whole process
        torch.distributions.Distribution.set_default_validate_args(validate)
    reasons = []
    for r in explanation.break_reasons:
        frame = r.user_stack[-1] if getattr(r, "user_stack", None) else None
        where = f" ({Path(frame.filename).name}:{frame.lineno} {frame.name})" if frame is not None else ""
        reasons.append(str(getattr(r, "reason", r)).splitlines()[0][:120] + where)
    torch._dynamo.reset()
    return {"graph_breaks": explanation.graph_break_count, "graphs": explanation.graph_count, "reasons": reasons}


def main(argv=None) -> int:
    p = parser("hot_path", __doc__.split("\n")[0], out="results/hot_path.json")
    p.add_argument("--families", default=",".join(FAMILIES),
                   help="comma-separated subset of " + ", ".join(FAMILIES))
    p.add_argument("--no-graph-breaks", action="store_true", help="skip torch._dynamo.explain (slow)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    names = [n for n in args.families.split(",") if n]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}; valid: {', '.join(FAMILIES)}")
    results = {}
    for name in names:
        results[name] = count_step(name)
        if not args.no_graph_breaks:
            results[name]["compile"] = {"cpu_path": graph_breaks(name),
                                        "accelerator_path": graph_breaks(name, accelerator_path=True)}
    record = {"question": "host syncs per training step and torch.compile graph breaks, per family",
              "config": {**TINY, "batch": BATCH, "syncs_layers": "2 dense + 2 sparse",
                         "graph_break_layers": "1 dense + 1 sparse"},
              **environment(), "families": results}
    print(f"{'family':<14}{'forward':>9}{'backward':>10}{'criterion':>11}{'breaks (CPU path)':>19}"
          f"{'breaks (accelerator path)':>27}")
    for name, r in results.items():
        cpu = r.get("compile", {}).get("cpu_path", {}).get("graph_breaks", "-")
        acc = r.get("compile", {}).get("accelerator_path", {}).get("graph_breaks", "-")
        print(f"{name:<14}{r['forward']:>9}{r['backward']:>10}{r['criterion']:>11}{cpu:>19}{acc:>27}")
    write_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
