"""How the balanced routers' evaluation routing scores a trained checkpoint, and why (issue 35: the validation
perplexity of equal trainings apart under greedy evaluation routing).

    python -m smlp_bench.micro.eval_routing CHECKPOINT [CHECKPOINT ...] --data DATA_BIN
        [--batches 20] [--batch-size 16] [--calibration-batches 30] [--out results/eval_routing.json]

For each checkpoint (a consolidated file or a rank-shard set), on the first --batches x --batch-size
validation blocks, one forward per routing of the balanced routers (Base Layers, the sMLP tMoE):

    trained   the training-time balanced assignment over each batch (not causal: the reference the others
              are measured against)
    greedy    argmax of the scores (fairseq's BaseLayer)
    priced    argmax of score - price with the prices the checkpoint holds (averaged over training)
    calibrated  the same with prices measured afresh: --calibration-batches training batches of 8 blocks
              routed in training mode (no gradient) at the checkpoint's weights

and per routing: the perplexity, the busiest expert's load over the mean per layer, the share of tokens per
layer routed to the expert the training-time assignment gives them, the share of tokens routed elsewhere in
at least one layer, and what those tokens cost (their mean loss minus the training-time routing's, in nats).
A table on the terminal, the JSON record at --out.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..store import environment, write_record
from . import parser

ROUTINGS = ("trained", "greedy", "priced", "calibrated")


def _batches(task, split: str, count: int, size: int, start: int = 0):
    ds = task.dataset(split)
    stop = min(len(ds), start + count * size)
    for b in range(start, stop - size + 1, size):
        yield ds.collater([ds[i] for i in range(b, b + size)])


def _balanced_layers(core):
    from smlp.moe import TMoE

    return [m for _, m in core.moe_modules() if isinstance(m, TMoE) and m.token_router.balanced]


class _PlanTap:
    """Keeps each balanced layer's expert per row of its last forward."""

    def __init__(self, layers):
        self.experts = [None] * len(layers)
        for i, layer in enumerate(layers):
            layer.route = self._wrap(layer.route, i)

    def _wrap(self, route, i):
        def tapped(*args, **kwargs):
            plan = route(*args, **kwargs)
            self.experts[i] = plan.experts_SK[:, 0].clone()
            return plan
        return tapped


def _score(model, core, layers, tap, valid, routing: str, pad: int):
    nll, experts = [], [[] for _ in layers]
    for layer in layers:  # priced, whatever the checkpoint's --balanced-eval-routing; greedy below
        layer.router.eval_prices.eval_routing = "priced"
    context = {"trained": core.assigning_as_in_training, "greedy": core.routing_greedily}.get(routing)
    for sample in valid:
        with torch.no_grad():
            if context is not None:
                with context():
                    out = model(**sample["net_input"])
            else:
                out = model(**sample["net_input"])
            lp = model.get_normalized_probs(out, log_probs=True)
        nll.append(F.nll_loss(lp.view(-1, lp.size(-1)), sample["target"].view(-1), ignore_index=pad,
                              reduction="none"))
        for i in range(len(layers)):
            experts[i].append(tap.experts[i])
    return torch.cat(nll), [torch.cat(e) for e in experts]


def _calibrate(model, core, layers, task, batches: int) -> None:
    """Prices measured afresh at the checkpoint's weights: training-mode routing of training batches, each folded
    as an optimizer step folds it."""
    from smlp.routing.prices import fold_prices

    for layer in layers:
        for buffer in layer.router.eval_prices.buffers():
            buffer.zero_()
    core.train()
    with torch.no_grad():
        for sample in _batches(task, "train", batches, 8):
            model(**sample["net_input"])
            fold_prices(core)
    core.eval()


def analyse(path: str, data: str, *, batches: int, batch_size: int, calibration: int) -> dict:
    import fairseq_plugins  # noqa: F401  (registers the models)
    from fairseq_plugins.checkpoints import load_for_eval

    model, task = load_for_eval(path, data)
    core = model.decoder.core
    layers = _balanced_layers(core)
    if not layers:
        raise SystemExit(f"{path}: the model has no balanced router (Base Layers, sMLP tMoE): nothing to compare")
    task.load_dataset("valid")
    task.load_dataset("train")
    pad = task.target_dictionary.pad()
    valid = list(_batches(task, "valid", batches, batch_size))
    tap = _PlanTap(layers)
    held = [float(layer.router.eval_prices.price_weight) for layer in layers]
    runs = {r: _score(model, core, layers, tap, valid, r, pad) for r in ("trained", "greedy", "priced")}
    _calibrate(model, core, layers, task, calibration)
    runs["calibrated"] = _score(model, core, layers, tap, valid, "calibrated", pad)
    ref_nll, ref_experts = runs["trained"]
    out = {"checkpoint": path, "tokens": int(ref_nll.numel()), "prices_held": all(w > 0 for w in held),
           "routings": {}}
    for name, (nll, experts) in runs.items():
        E = layers[0].cfg.num_experts
        loads = [torch.bincount(e, minlength=E).double() for e in experts]
        moved = torch.zeros_like(nll, dtype=torch.bool)
        for e, ref in zip(experts, ref_experts):
            moved |= e.ne(ref)
        fig = {"ppl": math.exp(nll.mean().item()),
               "max_load": [round((c.max() / c.mean()).item(), 3) for c in loads],
               "same_expert_as_trained": [round(e.eq(r).double().mean().item(), 4)
                                          for e, r in zip(experts, ref_experts)],
               "tokens_rerouted": moved.double().mean().item(),
               "cost_of_rerouted_nats": (nll[moved] - ref_nll[moved]).mean().item() if moved.any() else 0.0,
               "cost_of_others_nats": (nll[~moved] - ref_nll[~moved]).mean().item() if (~moved).any() else 0.0}
        out["routings"][name] = fig
    if not out["prices_held"]:
        out["routings"]["priced"]["note"] = "the checkpoint holds no prices (written before them): greedy"
    return out


def table(records: list[dict]) -> str:
    lines = ["| checkpoint | routing | ppl | busiest expert / mean | same expert as training | rerouted tokens | "
             "their cost (nats) |", "|---|---|---:|---|---|---:|---:|"]
    for r in records:
        for name, f in r["routings"].items():
            loads = ", ".join(f"{x:.2f}" for x in f["max_load"])
            lines.append(f"| {r['checkpoint']} | {name} | {f['ppl']:.2f} | {loads} "
                         f"| {', '.join(f'{x:.2f}' for x in f['same_expert_as_trained'])} | {f['tokens_rerouted']:.1%} "
                         f"| {f['cost_of_rerouted_nats']:+.4f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = parser("python -m smlp_bench.micro.eval_routing", __doc__, out="results/eval_routing.json")
    ap.add_argument("checkpoints", nargs="+", help="checkpoints (a consolidated .pt or the stem of a shard set)")
    ap.add_argument("--data", required=True, help="the data-bin the checkpoints were trained on")
    ap.add_argument("--batches", type=int, default=20, help="validation batches (20)")
    ap.add_argument("--batch-size", type=int, default=16, help="blocks per batch, as validation's --batch-size (16)")
    ap.add_argument("--calibration-batches", type=int, default=30, help="training batches for fresh prices (30)")
    args = ap.parse_args(argv)
    if args.batches < 1 or args.batch_size < 1 or args.calibration_batches < 1:
        ap.error("--batches, --batch-size and --calibration-batches must be positive")
    torch.set_num_threads(args.threads)
    records = [analyse(p, args.data, batches=args.batches, batch_size=args.batch_size,
                       calibration=args.calibration_batches) for p in args.checkpoints]
    write_record(args.out, {"benchmark": "eval_routing", "question": __doc__.split("\n")[0],
                            "config": {k: v for k, v in vars(args).items() if k != "out"}, "environment": environment(),
                            "checkpoints": records})
    print(table(records))
    print(f"record: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
