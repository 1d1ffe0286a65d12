"""What `smlp-flops` prints: a count, the FLOP matches, the paper's tables (3, 5, 8-10) and the
step-time model's results (Table 4), as text or markdown; the figures come from counting.py,
matching.py and steptime.py."""
from __future__ import annotations

from .counting import CONVENTION, FAMILY_NAMES, Count, cost_model, family_key, table3
from .matching import MatchRow
from .model_spec import parse_model
from .paper_figures import MATCH_TOLERANCE, PAPER_MODELS, TABLE3_DIMS, TABLE5

__all__ = ["describe", "format_count", "format_match", "format_paper_tables", "format_smoe_layouts", "format_step_time",
           "format_table4", "paper_tables", "table5_comparison"]


def _m(n: int) -> str:
    return f"{n / 1e6:,.2f}M" if n >= 1e5 or n == 0 else f"{n / 1e3:,.1f}K"


def _fl(n: int) -> str:
    for scale, unit, digits in ((1e11, "T", 4), (1e8, "G", 3), (1e5, "M", 3)):
        if n >= scale:
            return f"{n / (scale * 10):.{digits}f}{unit}"
    return f"{n:,}"


def describe(c: Count) -> str:
    cfg = c.cfg
    layers = f"{cfg.dense_layers} dense" + (f" + {cfg.sparse_layers} sparse" if cfg.sparse_layers else "")
    s = (f"{FAMILY_NAMES[family_key(cfg)]}: {layers} layers, D={cfg.d_model}, F={cfg.d_ffn}, T={cfg.seq_len}, "
         f"V={cfg.vocab_size}")
    if cfg.sparse_layers:
        s += f", {cfg.num_experts} experts, {c.experts_per_gpu} per GPU on {c.world_size} GPUs"
        if cfg.smoe_num_experts not in (0, cfg.num_experts):
            N = cfg.smoe_num_experts
            s += (f" (sMoE: {N} experts, " + (f"{N // c.world_size} per GPU)" if N % c.world_size == 0 else
                                              "all on every GPU)"))
    mixer = cfg.dense_mixer if cfg.family in ("smlp", "gmlp") else None
    if mixer is not None:
        sizes = {k: v for k, v in vars(mixer).items() if k not in ("dim", "seq_len", "chunk_size", "causal")}
        s += f", dense token mixer {cfg.token_mixer} ({', '.join(f'{k}={v}' for k, v in sizes.items())})"
    return s


def format_count(name: str, c: Count, markdown: bool = False) -> str:
    if markdown:
        head = "| model | layers | FLOPs | expert params / GPU | non-expert params | params / GPU | params total |"
        sep = "|---|---|---:|---:|---:|---:|---:|"
        layers = f"{c.cfg.dense_layers} + {c.cfg.sparse_layers}" if c.cfg.sparse_layers else str(c.cfg.dense_layers)
        row = (f"| {name} | {layers} | {_fl(c.flops)} | {_m(c.params_expert_per_gpu)} | {_m(c.params_non_expert)} "
               f"| {_m(c.params_per_gpu)} | {_m(c.params_total)} |")
        return "\n".join([head, sep, row, "", f"_{CONVENTION.format(T=c.tokens)}._"])
    lines = [f"{name}  ({describe(c)})",
             f"  FLOPs                     {_fl(c.flops):>12}  ({c.flops:,})",
             f"  expert params per GPU     {_m(c.params_expert_per_gpu):>12}",
             f"  non-expert params         {_m(c.params_non_expert):>12}",
             f"  params per GPU            {_m(c.params_per_gpu):>12}",
             f"  params total (all GPUs)   {_m(c.params_total):>12}",
             "  per layer (FLOPs, params/GPU):",
             f"    embedding + output      {_fl(2 * c.head.macs):>12}  {_m(c.head.params_non_expert)}",
             f"    dense layer  x{c.cfg.dense_layers:<4}     {_fl(2 * c.dense.macs):>12}  "
             f"{_m(c.dense.params_expert + c.dense.params_non_expert)}"]
    if c.sparse is not None:
        lines.append(f"    sparse layer x{c.cfg.sparse_layers:<4}     {_fl(2 * c.sparse.macs):>12}  "
                     f"{_m(c.sparse.params_expert)} expert + {_m(c.sparse.params_non_expert)} non-expert")
    lines += [f"  method: {c.method}", f"  {CONVENTION.format(T=c.tokens)}"]
    return "\n".join(lines)


def format_match(name: str, target: Count, rows: list[MatchRow], tolerance: float, markdown: bool = False) -> str:
    if markdown:
        out = [f"FLOPs matched to {name} ({_fl(target.flops)}), tolerance {tolerance:.1%}:", "",
               "| family | layers (dense + sparse) | FLOPs | vs target | params / GPU | non-expert params |",
               "|---|---|---:|---:|---:|---:|"]
        for r in rows:
            c = r.count
            layers = f"{c.cfg.dense_layers} + {c.cfg.sparse_layers}" if c.cfg.sparse_layers else str(c.cfg.dense_layers)
            mark = "" if r.within_tolerance else " (nearest, none within tolerance)"
            out.append(f"| {FAMILY_NAMES[r.family]} | {layers} | {_fl(c.flops)} | {r.rel:+.2%}{mark} "
                       f"| {_m(c.params_per_gpu)} | {_m(c.params_non_expert)} |")
        out += ["", f"_{CONVENTION.format(T=target.tokens)}._"]
        return "\n".join(out)
    out = [f"FLOPs matched to {name}: {describe(target)}, {_fl(target.flops)}",
           f"rule: within {tolerance:.1%} of the target, fewest layers (else the nearest)",
           f"  {'family':<20}{'layers':>8}  {'dense+sparse':>12}  {'FLOPs':>10}  {'vs target':>9}  "
           f"{'params/GPU':>12}  {'non-expert':>11}"]
    for r in rows:
        c = r.count
        split = f"{c.cfg.dense_layers}+{c.cfg.sparse_layers}"
        mark = "" if r.within_tolerance else "  (nearest; none within tolerance)"
        out.append(f"  {FAMILY_NAMES[r.family]:<20}{r.layers:>8}  {split:>12}  {_fl(c.flops):>10}  {r.rel:>+9.2%}  "
                   f"{_m(c.params_per_gpu):>12}  {_m(c.params_non_expert):>11}{mark}")
    out.append(f"  {CONVENTION.format(T=target.tokens)}")
    return "\n".join(out)


def paper_tables(method: str = "fvcore") -> dict:
    """Our derived figures for the configurations of Tables 3, 5, 8, 9, 10 (no paper figures here)."""
    models = []
    cache: dict = {}
    for pm in PAPER_MODELS:
        spec = parse_model(pm.arch, list(pm.flags))
        key = (spec.cfg.with_layers(1, 1 if spec.cfg.sparse_layers else 0), spec.tokens, spec.experts_per_gpu)
        if key not in cache:
            cache[key] = cost_model(spec.cfg, spec.tokens, experts_per_gpu=max(spec.experts_per_gpu, 1), method=method)
        c = cache[key].count(spec.cfg.dense_layers, spec.cfg.sparse_layers)
        models.append({"table": pm.table, "name": pm.name, "arch": pm.arch, **c.as_dict()})
    return {"table3": table3(), "models": models, "table5": table5_comparison(models)}


def table5_comparison(models: list[dict]) -> list[dict]:
    """Table 5 as printed beside our count of the architecture it prints, with the difference and its cause."""
    ours = {m["arch"]: m for m in models if m["table"] in ("5", "10")}
    rows = []
    for row in TABLE5:
        m = ours[row.arch]
        flops_diff = m["flops"] / (row.flops_T * 1e12) - 1
        size_diff = m["params_total"] / (row.size_B * 1e9) - 1
        rows.append({
            "name": row.name, "arch": row.arch, "dense_layers": m["dense_layers"],
            "sparse_layers": m["sparse_layers"], "paper_flops": row.flops_T * 1e12, "flops": m["flops"],
            "flops_diff": flops_diff, "flops_match": abs(flops_diff) <= MATCH_TOLERANCE,
            "paper_params_total": row.size_B * 1e9, "params_total": m["params_total"], "params_diff": size_diff,
            "params_match": abs(size_diff) <= MATCH_TOLERANCE, "cause": row.cause,
        })
    return rows


def format_paper_tables(tables: dict, markdown: bool = False) -> str:
    t3 = tables["table3"]
    if markdown:
        out = ["| Module | heads | params | FLOPs |", "|---|---:|---:|---:|"]
        out += [f"| {r['module']} | {r['heads']} | {r['params'] / 1e6:.3f}M | {r['flops'] / 1e9:.3f}G |" for r in t3]
        out += ["", "| table | model | layers (dense + sparse) | expert params / GPU | non-expert params | FLOPs |",
                "|---|---|---|---:|---:|---:|"]
        for m in tables["models"]:
            out.append(f"| {m['table']} | {m['name']} | {m['dense_layers']} + {m['sparse_layers']} "
                       f"| {_m(m['params_expert_per_gpu'])} | {_m(m['params_non_expert'])} | {_fl(m['flops'])} |")
        out += ["", "Table 5 as printed against our count of the printed architecture:", "",
                "| model | layers (dense + sparse) | FLOPs: ours (paper) | diff | params total: ours (paper) | diff "
                "| cause of a difference |", "|---|---|---:|---:|---:|---:|---|"]
        for r in tables["table5"]:
            out.append(f"| {r['name']} | {r['dense_layers']} + {r['sparse_layers']} | {_fl(r['flops'])} "
                       f"({r['paper_flops'] / 1e12:.1f}T) | {r['flops_diff']:+.1%} | {r['params_total'] / 1e9:.2f}B "
                       f"({r['paper_params_total'] / 1e9:.2f}B) | {r['params_diff']:+.1%} | {r['cause']} |")
        out += ["", f"_{CONVENTION.format(T=1024)}._"]
        return "\n".join(out)
    out = [f"Table 3 (T={TABLE3_DIMS['seq_len']}, D={TABLE3_DIMS['d_model']}, F={TABLE3_DIMS['d_ffn']}):",
           f"  {'module':<22}{'heads':>6}{'params':>12}{'FLOPs':>12}"]
    out += [f"  {r['module']:<22}{r['heads']:>6}{r['params'] / 1e6:>11.3f}M{r['flops'] / 1e9:>11.3f}G" for r in t3]
    out += ["", "Tables 5, 8-10:",
            f"  {'table':<6}{'model':<30}{'layers':>8}{'expert/GPU':>13}{'non-expert':>13}{'FLOPs':>10}"]
    for m in tables["models"]:
        out.append(f"  {m['table']:<6}{m['name']:<30}{m['dense_layers']:>4}+{m['sparse_layers']:<3}"
                   f"{_m(m['params_expert_per_gpu']):>13}{_m(m['params_non_expert']):>13}{_fl(m['flops']):>10}")
    out += ["", f"Table 5 as printed vs our count of the printed architecture (match: within {MATCH_TOLERANCE:.0%}):",
            f"  {'model':<30}{'layers':>8}{'FLOPs ours':>12}{'paper':>8}{'diff':>8}{'params ours':>13}{'paper':>8}"
            f"{'diff':>8}"]
    for r in tables["table5"]:
        out.append(f"  {r['name']:<30}{r['dense_layers']:>4}+{r['sparse_layers']:<3}{_fl(r['flops']):>12}"
                   f"{r['paper_flops'] / 1e12:>7.1f}T{r['flops_diff']:>+8.1%}{r['params_total'] / 1e9:>12.2f}B"
                   f"{r['paper_params_total'] / 1e9:>7.2f}B{r['params_diff']:>+8.1%}")
        if r["cause"]:
            out.append(f"      {r['cause']}")
    out.append(f"  {CONVENTION.format(T=1024)}")
    return "\n".join(out)



def _gb(n: float) -> str:
    return f"{n / 2 ** 30:.1f}G"


def format_step_time(st) -> str:
    t, c = st.train, st.cluster
    lines = [f"{st.name}: {t.world_size} GPUs ({c.name}), expert-parallel groups of {t.ep_size} ({t.replicas} "
             f"replica(s)), {t.batch_size} x {t.tokens} tokens x {t.update_freq} micro-batches per GPU, "
             f"{'fp16' if t.fp16 else 'fp32'}{', optimizer state sharded' if t.optimizer_sharding else ''}",
             "  all2all per sparse layer per micro-batch (bytes leaving one GPU; x4 per step: fwd + bwd):"]
    for e in st.exchanges:
        lines.append(f"    {e.name:<14} {e.rows:>9,} rows x {e.row_bytes:>6,} B  {e.bytes_sent / 2 ** 20:>9.2f} MiB")
    ar = st.allreduce
    lines.append(f"  all-reduce per update: non-expert {ar['non_expert_bytes'] / 2 ** 20:,.1f} MiB over "
                 f"{ar['non_expert_ranks']} "
                 f"ranks; expert {ar['expert_bytes'] / 2 ** 20:,.1f} MiB over {ar['expert_ranks']} replica(s) "
                 f"x {ar['expert_reductions']}")
    m = st.memory
    lines.append(f"  memory per GPU: weights+grads {_gb(m['weights_and_grads'])}, Adam {_gb(m['adam_moments'])} "
                 f"(unsharded {_gb(m['adam_moments_unsharded'])}), activations {_gb(m['activations'])}: total "
                 f"{_gb(m['total'])} of {_gb(c.gpu_memory)}")
    parts = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in st.seconds.items())
    lines.append(f"  step {st.step_seconds:.3f} s ({parts}); {st.words_per_second / 1e3:,.0f}k words/s")
    return "\n".join(lines)


def format_table4(rows: list[dict], markdown: bool = False) -> str:
    out = []
    for part in ("top", "bottom"):
        mine = [r for r in rows if r["part"] == part]
        if not mine:
            continue
        title = ("Table 4 (top): small models, 0.8T FLOPs" if part == "top"
                 else "Table 4 (bottom): scaled-up models, 2.0T FLOPs")
        c = mine[0]["cluster"]
        out.append(f"{title}; predicted on 32 x {c['name']} (capacity-padded GShard / Switch, as the paper's "
                   f"implementations):")
        if markdown:
            out += ["", "| model | predicted words/s | vs sMLP | paper words/s | vs sMLP | rank: ours (paper) "
                        "| compute | memory-bound | all2all | all-reduce | memory / GPU |",
                    "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
        for r in sorted(mine, key=lambda r: r["rank"]):
            s = r["seconds"]
            ar = s["allreduce_non_expert"] + s["allreduce_expert"]
            if markdown:
                out.append(f"| {r['name']} | {r['words_per_second'] / 1e3:.0f}k | {r['vs_smlp']:.2f} "
                           f"| {r['paper_wps'] / 1e3:.0f}k | {r['paper_vs_smlp']:.2f} "
                           f"| {r['rank']} ({r['paper_rank']}) "
                           f"| {s['compute']:.2f} s | {s['memory_bound']:.2f} s | {s['all2all']:.2f} s | {ar:.3f} s "
                           f"| {_gb(r['memory_bytes']['total'])} |")
            else:
                out.append(f"  {r['rank']}. {r['name']:<30} {r['words_per_second'] / 1e3:>6.0f}k "
                           f"({r['vs_smlp']:.2f} of sMLP)   paper {r['paper_wps'] / 1e3:>4.0f}k "
                           f"({r['paper_vs_smlp']:.2f}, rank {r['paper_rank']})   compute {s['compute']:.2f} s, "
                           f"memory-bound {s['memory_bound']:.2f} s, all2all {s['all2all']:.2f} s, "
                           f"all-reduce {ar:.3f} s, {_gb(r['memory_bytes']['total'])}/GPU")
                if r["note"]:
                    out.append(f"       {r['note']}")
        out.append("")
    return "\n".join(out).rstrip()


def format_smoe_layouts(rows: list[dict], markdown: bool = False) -> str:
    """`smlp-flops --smoe-layouts`: each configuration's step with the sMoE expert-parallel and replicated."""
    out = []
    if markdown:
        out += ["| configuration | cluster | step, sMoE expert-parallel | step, sMoE replicated | faster | by | "
                "memory / GPU (expert -> replicated) | default (--smoe-parallel auto) |",
                "|---|---|---:|---:|---|---:|---:|---|"]
    for r in rows:
        e, p = r["step_times"]["expert"], r["step_times"]["replicated"]
        mem = f"{_gb(e['memory_bytes']['total'])} -> {_gb(p['memory_bytes']['total'])}"
        if markdown:
            out.append(f"| {r['case']} | {r['cluster']} | {e['step_seconds']:.3f} s | {p['step_seconds']:.3f} s "
                       f"| {r['faster']} | {r['speedup']:.2f}x | {mem} | {r['default']} |")
            continue
        out.append(f"{r['case']} ({r['cluster']}): {r['faster']} is {r['speedup']:.2f}x faster")
        for name, st in (("expert-parallel", e), ("replicated", p)):
            parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in st["seconds"].items())
            out.append(f"  sMoE {name:<16} step {st['step_seconds']:.3f} s ({parts}); "
                       f"{_gb(st['memory_bytes']['total'])}/GPU")
        out.append(f"  --smoe-parallel auto: {r['default']} ({r['why']})")
    return "\n".join(out)
