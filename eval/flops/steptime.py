"""Step-time model of models given as fairseq flags, Table 4 and the sMoE layout comparisons.

The model itself (clusters, exchanges, memory, the time of one update, the sMoE layout choice) is
smlp/steptime.py: fairseq-free, so that the plugins can choose `--smoe-parallel auto` from it without
importing this package. This module counts a model given as fairseq flags (model_spec.py) and feeds it in:
`smlp-flops --step-time`, `--table4` and `--smoe-layouts` (command.py) print it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from smlp.steptime import (
    CLUSTERS,
    SMOE_LAYOUTS,
    Training,
    choose_smoe_layout,
    smoe_expert_params,
    step_time,
)

from .activations import activation_bytes
from .model_spec import ModelSpec, count_spec, parse_model

__all__ = ["TABLE4", "Table4Row", "step_time_for", "table4", "compare_smoe_layouts",
           "smoe_layout_sentence", "SMOE_LAYOUT_CASES", "smoe_layout_report"]


@dataclass(frozen=True)
class Table4Row:
    name: str
    arch: str
    flags: tuple[str, ...]
    paper_wps: float
    note: str = ""


# Table 4 (top): the small models (0.8T FLOPs), 32 V100s, Table 8's batch: 4 sequences x 4 accumulated
# per GPU. The paper prints GShard's size as Switch's (3.48B): the same 12 + 12 architecture, top-2.
_SMALL = ("--distributed-world-size", "32", "--batch-size", "4", "--update-freq", "4", "--fp16")
# Table 4 (bottom): the scaled-up models (Table 5 / 10), 2 sequences x 8 accumulated per GPU.
_LARGE = ("--distributed-world-size", "32", "--batch-size", "2", "--update-freq", "8", "--fp16")
TABLE4 = {
    "top": (
        Table4Row("GShard", "base_layers_lm_paper_small", ("--moe-router", "gshard", *_SMALL), 136e3,
                  "top-2: two FFN experts per token and twice the all2all rows (capacity 2S/E)"),
        Table4Row("Switch Transformer", "base_layers_lm_paper_small", ("--moe-router", "switch", *_SMALL), 185e3),
        Table4Row("Base Layers", "base_layers_lm_paper_small", _SMALL, 178e3,
                  "training-time shuffle of the routing scores (S x E) and experts back; the auction is not modelled"),
        Table4Row("HASH Layers", "base_layers_lm_paper_small", ("--moe-router", "hash", *_SMALL), 176e3,
                  "modelled as balanced; a fixed token-id hash loads frequent tokens' experts more"),
        Table4Row("sMLP-deterministic", "smlp_lm_paper_small", _SMALL, 192e3,
                  "no attention (its T x T softmax is memory-bound); sMoE + tMoE all2all in 12 sparse blocks"),
    ),
    "bottom": (
        Table4Row("GShard", "gshard_lm_paper_large", _LARGE, 115e3),
        Table4Row("Switch Transformer", "switch_lm_paper_large", _LARGE, 139e3),
        Table4Row("Switch Transformer - Enlarge", "switch_enlarge_lm_paper_large", _LARGE, 126e3),
        Table4Row("Base Layers", "base_layers_lm_paper_large", _LARGE, 135e3),
        Table4Row("HASH Layers", "hash_layers_lm_paper_large", _LARGE, 141e3),
        Table4Row("sMLP-deterministic", "smlp_lm_paper_large", _LARGE, 144e3),
    ),
}


# ---------------------------------------------------------------- a model given as fairseq flags


def step_time_for(spec: ModelSpec, cluster, *, name: str | None = None, padding: bool = False,
                  method: str = "fvcore", smoe_layout: str = "expert", all2all_chunks: int | None = None):
    """The step-time model of a model given as fairseq flags (with --batch-size etc.) on `cluster`;
    all2all_chunks: the flags' --all2all-chunks unless given."""
    if not spec.batch_size:
        raise ValueError("the step-time model needs --batch-size (sequences per GPU per micro-batch), e.g. "
                         "--batch-size 4 --update-freq 4 --distributed-world-size 32 --fp16")
    c = count_spec(spec, method)
    if smoe_layout == "expert" and not smoe_spreads(spec):
        raise ValueError(f"--smoe-parallel expert: the sMoE's {spec.cfg.smoe_num_experts} experts (--smoe-experts) do "
                         f"not spread over expert-parallel groups of {spec.ep_size}; use --smoe-parallel replicated")
    train = Training(world_size=spec.world_size, ep_size=spec.ep_size if spec.cfg.sparse_layers else 1,
                              batch_size=spec.batch_size, update_freq=spec.update_freq, tokens=spec.tokens,
                              fp16=spec.fp16, optimizer_sharding=spec.zero_sharding, padding=padding,
                              smoe_layout=smoe_layout if smoe_expert_params(spec.cfg, 1) else "expert",
                              all2all_chunks=spec.all2all_chunks if all2all_chunks is None else all2all_chunks)
    acts = activation_bytes(spec.cfg, spec.tokens, max(spec.experts_per_gpu, 1))
    recompute = None
    if spec.cfg.checkpoint_activations:  # every block's forward again in backward: all but the head's FLOPs
        plain = activation_bytes(replace(spec.cfg, checkpoint_activations=False), spec.tokens,
                                 max(spec.experts_per_gpu, 1))
        recompute = (c.flops - 2 * c.head.macs, plain)
    return step_time(name or spec.arch, spec.cfg, flops_per_sequence=c.flops,
                              params_non_expert=c.params_non_expert, params_expert_per_gpu=c.params_expert_per_gpu,
                              train=train, cluster=cluster, activations=acts, recompute=recompute)


def table4(which: str, cluster, method: str = "fvcore", smoe_layout: str = "faster",
           all2all_chunks: int = 1) -> list[dict]:
    """Predicted words/s of the paper's 32-GPU Table 4 configurations beside the paper's, ranked.

    smoe_layout: the sMLP rows' sMoE layout, "expert", "replicated" or "faster" (the better of the two;
    the row's `smoe_layouts` holds both step times). all2all_chunks: every model's exchanges overlapped
    with its experts in 2 chunks, or not (1)."""
    rows = []
    for part in (("top", "bottom") if which == "both" else (which,)):
        for row in TABLE4[part]:
            spec = parse_model(row.arch, list(row.flags))
            note = row.note
            if smoe_expert_params(spec.cfg, 1) and smoe_layout == "faster":
                both = compare_smoe_layouts(spec, cluster, name=row.name, padding=True, method=method,
                                            all2all_chunks=all2all_chunks)
                st = both["step_times"][both["faster"]]
                note = (f"{note}; " if note else "") + smoe_layout_sentence(both)
                extra = {"smoe_layouts": {k: v.step_seconds for k, v in both["step_times"].items()}}
            else:
                st = step_time_for(spec, cluster, name=row.name, padding=True, method=method,
                                   smoe_layout="expert" if smoe_layout == "faster" else smoe_layout,
                                   all2all_chunks=all2all_chunks)
                extra = {}
            rows.append({"part": part, "name": row.name, "arch": row.arch, "flags": " ".join(row.flags),
                         "paper_wps": row.paper_wps, "note": note, **st.as_dict(), **extra})
    for part in {r["part"] for r in rows}:
        mine = [r for r in rows if r["part"] == part]
        for key, rank_key in (("words_per_second", "rank"), ("paper_wps", "paper_rank")):
            for i, r in enumerate(sorted(mine, key=lambda r: -r[key])):
                r[rank_key] = i + 1
        ref = next(r for r in mine if r["name"].startswith("sMLP"))
        for r in mine:
            r["vs_smlp"] = r["words_per_second"] / ref["words_per_second"]
            r["paper_vs_smlp"] = r["paper_wps"] / ref["paper_wps"]
    return rows


# ---------------------------------------------------------------- the sMoE's parallel layout


def compare_smoe_layouts(spec: ModelSpec, cluster, *, name: str | None = None, padding: bool = False,
                         method: str = "fvcore", all2all_chunks: int | None = None) -> dict:
    """Both sMoE layouts of an sMLP given as fairseq flags on `cluster`: {"step_times": {layout:
    StepTime}, "faster": the layout of the shorter step, "speedup": slower step / faster step}."""
    if not smoe_expert_params(spec.cfg, 1):
        raise ValueError(f"{spec.arch} has no sMoE: only the sMLP's sparse blocks have a layout to choose")
    layouts = SMOE_LAYOUTS if smoe_spreads(spec) else ("replicated",)  # the only one where the group cannot
    times = {layout: step_time_for(spec, cluster, name=name, padding=padding, method=method, smoe_layout=layout,
                                   all2all_chunks=all2all_chunks) for layout in layouts}
    faster = min(layouts, key=lambda k: times[k].step_seconds)
    slower = max(layouts, key=lambda k: times[k].step_seconds)
    return {"step_times": times, "faster": faster, "speedup": times[slower].step_seconds / times[faster].step_seconds,
            "experts": spec.cfg.smoe_num_experts, "ep_size": spec.ep_size}


def smoe_spreads(spec: ModelSpec) -> bool:
    """Whether the sMoE's experts spread over the expert-parallel group (its size divides them: --smoe-experts)."""
    return spec.cfg.smoe_num_experts % max(spec.ep_size, 1) == 0


def smoe_layout_sentence(both: dict) -> str:
    """One line: which sMoE layout is faster, by how much, and both step times."""
    t = both["step_times"]
    if "expert" not in t:
        return (f"sMoE replicated ({t['replicated'].step_seconds:.3f} s: its {both['experts']} experts do not spread "
                f"over expert-parallel groups of {both['ep_size']})")
    other = {"replicated": "expert-parallel", "expert": "replicated"}[both["faster"]]
    return (f"sMoE {both['faster']} ({both['speedup']:.2f}x faster than {other}: {t['expert'].step_seconds:.3f} s "
            f"expert-parallel, {t['replicated'].step_seconds:.3f} s replicated)")


# the configurations `smlp-flops --smoe-layouts` compares: the paper's two sMLPs on its 32 V100s (Table 4's
# flags) and smlp-bench --fair's sMLP-det on 2 CPU ranks (benchmarks/fair.py: D=128, F=512, T=128, 9 + 3 blocks,
# 8 experts, 16 sequences per rank, a vocabulary about the demo corpus's)
SMOE_LAYOUT_CASES = (
    ("paper small, 32 V100s", "smlp_lm_paper_small", _SMALL, "v100-dgx1", 51200),
    ("paper large, 32 V100s", "smlp_lm_paper_large", _LARGE, "v100-dgx1", 51200),
    ("CPU benchmark, 2 gloo ranks", "smlp_lm",
     ("--decoder-embed-dim", "128", "--decoder-ffn-embed-dim", "512", "--tokens-per-sample", "128",
      "--decoder-layers", "9", "--sparse-layers", "3", "--num-experts", "8", "--distributed-world-size", "2",
      "--batch-size", "16"), "cpu-gloo", 4000),
)


def smoe_layout_report(method: str = "fvcore") -> list[dict]:
    """Both sMoE layouts of SMOE_LAYOUT_CASES, with the faster one and the default `choose_smoe_layout` gives."""
    rows = []
    for title, arch, flags, cluster_name, vocab in SMOE_LAYOUT_CASES:
        spec = parse_model(arch, list(flags), vocab_size=vocab)
        cluster = CLUSTERS[cluster_name]
        both = compare_smoe_layouts(spec, cluster, name=title, method=method)
        default, why = choose_smoe_layout(spec.cfg, world_size=spec.world_size, ep_size=spec.ep_size,
                                          batch_size=spec.batch_size, tokens=spec.tokens,
                                          update_freq=spec.update_freq,
                                          device_type="cpu" if cluster_name.startswith("cpu") else "cuda")
        rows.append({"case": title, "arch": arch, "flags": " ".join(flags), "cluster": cluster_name,
                     "faster": both["faster"], "speedup": both["speedup"], "default": default, "why": why,
                     "step_times": {k: v.as_dict() for k, v in both["step_times"].items()}})
    return rows
