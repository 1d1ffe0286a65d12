"""The benchmark's models and presets: the target sMLP, its FLOP matches (`plan_models`; a plan stores each
`Model.as_dict()`, `models_from_plan` reads it back), and how each preset trains them (docs/benchmarks.md)."""
from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from smlp.routing.registry import SMOE_ROUTINGS, TOKEN_ROUTERS

# The target and its width (CPU scale that still means something: d_model >= 256, sequence >= 256).
TARGET = dict(d_model=256, d_ffn=1024, seq_len=256, dense=9, sparse=3)
# The long preset's target: half the width and half the sequence (module docstring, "Presets").
LONG_TARGET = dict(d_model=128, d_ffn=512, seq_len=128, dense=9, sparse=3)
MATCH_TOLERANCE = 0.03
# The Transformer-MoE baselines: every token router of the registry (smlp/routing/registry.py), by its name.
MOE_BASELINES = tuple(TOKEN_ROUTERS)
OUR_FAMILIES = ("transformer", "gmlp", "hypermixer", "ninformer", *MOE_BASELINES)
MODEL_ORDER = ("smlp_det", "smlp_partial", "gmlp", "hypermixer", "ninformer", "transformer", *MOE_BASELINES,
               "fairseq_transformer_lm", "fairseq_base_layers")
NAMES = {"smlp_det": SMOE_ROUTINGS["deterministic"].title, "smlp_partial": SMOE_ROUTINGS["partial"].title,
         "gmlp": "gMLP", "transformer": "Transformer", "hypermixer": "HyperMixer (causal)",
         "ninformer": "NiNformer (causal)", **{r.name: r.title for r in TOKEN_ROUTERS.values()},
         "fairseq_transformer_lm": "fairseq transformer_lm",
         "fairseq_base_layers": "fairseq transformer_lm --base-layers"}
REFERENCE = "smlp_det"
# causal HyperMixer's step takes ~12 s a block here against ~0.1 s for the SGU (smlp/hypermixer.py): only when
# asked for (--models ...,hypermixer)
DEFAULT_MODELS = tuple(k for k in MODEL_ORDER if k != "hypermixer")
# The FLOP-matched families of the long preset (no fairseq anchors: they check our speed, not quality).
LONG_MODELS = ("smlp_det", "smlp_partial", "gmlp", "ninformer", "transformer", *MOE_BASELINES)
PRESETS = {
    # quick: one seed, short runs (a smoke test of the comparison)
    "quick": dict(seeds=1, updates=24, batch_size=4, log_interval=2, validate_every=8, valid_steps=8,
                  warmup=8, lr=2e-3, profile_steps=2, probe_updates=10, target=TARGET, models=DEFAULT_MODELS),
    # full: three seeds, longer runs (~95 s a run, ~13 s of it validation)
    "full": dict(seeds=3, updates=60, batch_size=4, log_interval=2, validate_every=15, valid_steps=8,
                 warmup=10, lr=2e-3, profile_steps=3, probe_updates=12, target=TARGET, models=DEFAULT_MODELS),
    # long: 25x the full preset's tokens, then a second seed for the three best
    "long": dict(seeds=1, updates=750, batch_size=16, log_interval=10, validate_every=50, valid_steps=10,
                 warmup=50, lr=2e-3, profile_steps=3, probe_updates=20, target=LONG_TARGET, models=LONG_MODELS,
                 second_phase=dict(top=3, seeds=[2])),
}


class BenchError(Exception):
    """A problem with the benchmark's input or one of its runs; the message is for the user."""


# Refusing arguments: each command's `check_args(args)` (called by smlp-bench before any work: no corpus built, no
# folder made, no model planned) raises BenchError through these, one line for the user.

def check_names(names: Sequence[str], valid: Sequence[str], flag: str) -> list[str]:
    """`names` when each is one of `valid`; else refused, naming the unknown ones and the valid ones."""
    if unknown := [n for n in names if n not in valid]:
        raise BenchError(f"{flag}: unknown {', '.join(unknown)}; valid: {', '.join(valid)}")
    return list(names)


def parse_names(text: str, valid: Sequence[str], flag: str) -> list[str]:
    """A comma-separated list of at least one of `valid`."""
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    if not names:
        raise BenchError(f"{flag} {text!r}: name at least one of {', '.join(valid)}")
    return check_names(names, valid, flag)


def parse_counts(text: str, flag: str, example: str) -> list[int]:
    """A comma-separated list of positive integers, sorted, each once (process counts, widths)."""
    try:
        counts = sorted({int(n) for n in str(text).split(",") if n.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise BenchError(f"{flag} {text}: give positive integers, e.g. {example}")
    return counts


def check_at_least(value: int | float, least: int | float, flag: str, why: str = "") -> None:
    if value < least:
        raise BenchError(f"{flag} {value}: give at least {least}{f' ({why})' if why else ''}")


def refuse(prog: str, exc: BenchError, code: int = 2):
    """Exit with the one line `PROG: error: ...` on stderr."""
    print(f"{prog}: error: {exc}", file=sys.stderr)
    raise SystemExit(code)


def parse_checked(parser, argv, check):
    """`python -m` entry points: the arguments parsed and checked; a refused one exits in one line."""
    args = parser.parse_args(argv)
    try:
        check(args)
    except BenchError as exc:
        refuse(parser.prog, exc)
    return args


@dataclass
class Model:
    key: str
    flags: list[str]                  # fairseq-train model flags
    fwd_flops_per_seq: int            # calculator, one sequence of seq_len tokens
    layers: str
    ours: bool = True
    note: str = ""
    seq_len: int = TARGET["seq_len"]
    name: str = ""                    # display name (default NAMES[key])
    executed_fwd_flops_per_seq: int | None = None  # without the causal zero triangles (None: as counted)
    lr: float | None = None           # its own peak learning rate (None: the preset's)

    @property
    def train_flops_per_token(self) -> float:
        return 3.0 * self.fwd_flops_per_seq / self.seq_len

    @property
    def executed_train_flops_per_token(self) -> float:
        return 3.0 * (self.executed_fwd_flops_per_seq or self.fwd_flops_per_seq) / self.seq_len

    @property
    def title(self) -> str:
        return self.name or NAMES.get(self.key, self.key)

    def as_dict(self) -> dict:
        return {"key": self.key, "flags": self.flags, "fwd_flops_per_seq": self.fwd_flops_per_seq,
                "layers": self.layers, "ours": self.ours, "note": self.note, "seq_len": self.seq_len,
                "name": self.title, "executed_fwd_flops_per_seq": self.executed_fwd_flops_per_seq,
                **({"lr": self.lr} if self.lr is not None else {})}


def target_flags(target: dict, nproc: int) -> list[str]:
    t = target
    return ["--arch", "smlp_lm", "--decoder-embed-dim", str(t["d_model"]), "--decoder-ffn-embed-dim",
            str(t["d_ffn"]), "--tokens-per-sample", str(t["seq_len"]), "--decoder-layers", str(t["dense"]),
            "--sparse-layers", str(t["sparse"]), "--num-experts", str(t.get("experts", nproc)),
            *(["--smoe-experts", str(t["smoe_experts"])] if t.get("smoe_experts") else [])]


def model_of(key: str, count, **fields) -> Model:
    """The Model that trains a counted core config (`smlp_eval.flops`), by the flags that carry every field of it."""
    from smlp_eval import flops as F

    c = count.cfg
    return Model(key, F.fairseq_flags(c).split(), count.flops,
                 f"{c.dense_layers}+{c.sparse_layers}" if c.sparse_layers else str(c.dense_layers), seq_len=c.seq_len,
                 executed_fwd_flops_per_seq=2 * F.executed_macs(count), **fields)


def plan_models(vocab_size: int, nproc: int, keys: Sequence[str], target: dict = TARGET) -> tuple[list[Model], dict]:
    """The target and its FLOP matches, from the calculator (`smlp_eval.flops`)."""
    from smlp_eval import flops as F

    t = target
    width = ["--decoder-embed-dim", str(t["d_model"]), "--decoder-ffn-embed-dim", str(t["d_ffn"]),
             "--tokens-per-sample", str(t["seq_len"])]
    tflags = target_flags(t, nproc)
    spec = F.parse_model("smlp_lm", tflags[2:], vocab_size=vocab_size)
    tcount = F.count_spec(spec)
    rows = {r.family: r for r in F.match(tcount, tolerance=MATCH_TOLERANCE, families=OUR_FAMILIES)}
    partial = F.count_spec(F.parse_model("smlp_lm", [*tflags[2:], "--smoe-routing", "partial"],
                                         vocab_size=vocab_size))
    T = t["seq_len"]
    models = [Model("smlp_det", tflags, tcount.flops, f"{t['dense']}+{t['sparse']}", seq_len=T,
                    executed_fwd_flops_per_seq=2 * F.executed_macs(tcount)),
              Model("smlp_partial", [*tflags, "--smoe-routing", "partial"], partial.flops,
                    f"{t['dense']}+{t['sparse']}", seq_len=T, executed_fwd_flops_per_seq=2 * F.executed_macs(partial))]
    models += [model_of(f, rows[f].count, note="" if rows[f].within_tolerance else
                        f"nearest FLOPs match: {rows[f].rel:+.1%}") for f in OUR_FAMILIES]
    # fairseq's own transformer_lm at the sizes of our Transformer and Base Layers
    tr, base = rows["transformer"].count.cfg, rows["base"].count.cfg
    # transformer_lm's --decoder-input-dim / --decoder-output-dim default to 512 whatever the model width
    # (a 512-wide embedding with projections in and out): set them to D for the same model as ours.
    fairseq_common = ["--arch", "transformer_lm", *width, "--decoder-attention-heads", str(tr.heads),
                      "--decoder-input-dim", str(t["d_model"]), "--decoder-output-dim", str(t["d_model"]),
                      "--decoder-normalize-before", "--share-decoder-input-output-embed", "--activation-fn", "gelu",
                      "--attention-dropout", "0"]
    models.append(Model("fairseq_transformer_lm", [*fairseq_common, "--decoder-layers", str(tr.dense_layers)],
                        rows["transformer"].count.flops, str(tr.dense_layers), ours=False, seq_len=T))
    # fairseq's --base-layers stack is our Base Layers stack minus the attention of its sparse blocks: its BaseLayer is
    # the routed FFN alone (with its own LayerNorm); an attention sublayer costs the dense Transformer block's minus
    # its FFN (2 D F multiply-adds per token) and that FFN's LayerNorm
    attention_macs = rows["base"].count.dense.macs - 2 * t["d_model"] * t["d_ffn"] * T - 5 * T * t["d_model"]
    base_flops = rows["base"].count.flops - 2 * base.sparse_layers * attention_macs
    models.append(Model("fairseq_base_layers", [*fairseq_common, "--decoder-layers", str(base.dense_layers),
                                                "--base-layers", str(base.sparse_layers), "--base-sublayers", "1",
                                                "--base-shuffle", "1"],
                        base_flops, f"{base.dense_layers}+{base.sparse_layers}", ours=False, seq_len=T,
                        note="fairseq's BaseLayer has no attention: fewer FLOPs than our Base Layers"))
    by_key = {m.key: m for m in models}
    check_names(keys, MODEL_ORDER, "--models")
    matching = {"target": {"arch": "smlp_lm", **t, "experts": t.get("experts", nproc), "flops": tcount.flops},
                "tolerance": MATCH_TOLERANCE, "matches": [r.as_dict() for r in rows.values()]}
    return [by_key[k] for k in keys], matching


def models_from_plan(plan: dict) -> list[Model]:
    return [Model(key=m["key"], flags=list(m["flags"]), fwd_flops_per_seq=m["fwd_flops_per_seq"], layers=m["layers"],
                  ours=m["ours"], note=m["note"], seq_len=m["seq_len"], name=m["name"],
                  executed_fwd_flops_per_seq=m.get("executed_fwd_flops_per_seq"), lr=m.get("lr"))
            for m in plan["models"]]
