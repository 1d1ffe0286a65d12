"""What `smlp-bench speed` publishes from its record (OUTPUT_DIR/speed.json, measured by benchmarks/speed.py): the
speed section of docs/benchmarks.md (one record's tables, with a before/after table against another record), the
width section and its figure (a record of several widths), README's speed sentence, and both sections' markers."""
from __future__ import annotations

import json
from pathlib import Path

from smlp.files import write_figure
from smlp.profiling import routing_and_all2all

from .fair import FAIR_TARGET
from .presets import NAMES, BenchError
from .publish import PAGE, replace_section
from .report import _pyplot
from .store import write_text

START, END = "<!-- smlp-speed:start -->", "<!-- smlp-speed:end -->"
# the width section (a record of several widths) and its figure, relative to the page's folder
WIDTHS_START, WIDTHS_END = "<!-- smlp-speed-widths:start -->", "<!-- smlp-speed-widths:end -->"
WIDTHS_FIGURE = Path("benchmark/speed/widths.png")


def _cell(r: dict | float | None) -> str:
    if isinstance(r, float):  # a record of one side, written before issue 47: ratios without their range
        return f"{r:.3f}x"
    return f"{r['ratio']:.3f}x [{r['lo']:.2f}-{r['hi']:.2f}]" if r else "-"


def _kept(side: dict, key: str | None) -> str:
    """`, 93.1% of tokens kept` for a model whose experts dropped routing slots (records before issue 53: empty)."""
    kept = ((side.get("models") or {}).get(key) or {}).get("tokens_kept")
    return f", {kept:.1%} of tokens kept" if kept is not None else ""


def markdown(speed: dict, figure: str | None = None) -> str:
    """A speed record as its section of docs/benchmarks.md shows it (a record of several widths: `widths_markdown`,
    with the `figure` linked)."""
    if "widths" in speed:
        return widths_markdown(speed, figure)
    m, s = speed.get("machine") or {}, speed["settings"]
    sides = speed.get("sides") or {"2": speed}  # a record of one side (2 ranks), written before issue 47
    at = f" at commit {_commit(speed)}" if speed.get("code") else ""
    t = s.get("target") or FAIR_TARGET
    width = "" if t["d_model"] == FAIR_TARGET["d_model"] else f" at D={t['d_model']}, d_ffn={t['d_ffn']}"
    lines = [f"Measured by `python -m smlp_bench.speed`{at} on {m.get('cpu_model') or m.get('cpu', '?')}, gloo "
             f"ranks x 1 thread, {s['updates']} updates x {s['seeds']} interleaved round(s) per model, fair "
             f"configuration{width} (8 experts); {'complete' if speed['complete'] else 'PARTIAL'}. Ratios from "
             f"{speed.get('ratios_from', 'runs adjacent in time, probe-normalized')}: median [range] over rounds.", "",
             "| processes | model | words/s [range] | over gMLP | over the fastest Transformer-MoE "
             "| routing + all2all share |", "|---:|---|---:|---:|---:|---:|"]
    for n, side in sides.items():
        for r in side["rows"]:
            b = r.get("breakdown") or {}
            share = f"{routing_and_all2all(b):.1%}" if "routing" in b and "all2all" in b else "-"
            span = f" [{r['wps_range'][0]:,.0f}-{r['wps_range'][1]:,.0f}]" if r.get("wps_range") else ""
            lines.append(f"| {n} | {r['name']} | {r['wps'] or 0:,.0f}{span} | {_cell(r['gMLP'])} "
                         f"| {_cell(r['fastest Transformer-MoE'])}"
                         f"{f' ({m}{_kept(side, m)})' if (m := side['fastest_moe']) else ''} "
                         f"| {share} |")
    if speed.get("scaling"):
        lines += ["", "| scaling (words/s on 2 ranks / 2 x on 1 process) | " +
                  " | ".join(NAMES.get(k, k) for k in speed["scaling"]) + " |",
                  "|---|" + "---:|" * len(speed["scaling"]),
                  "| | " + " | ".join(f"{v:.2f}" for v in speed["scaling"].values()) + " |"]
    lines += ["", "| target | measured | goal | met |", "|---|---:|---|---|", *_target_rows(speed["targets"])]
    return "\n".join(lines)


def _target_rows(targets: list[dict]) -> list[str]:
    """The rows of a targets table: measured (with its range over rounds where the target has one), goal, met."""
    rows = []
    for t in targets:
        v = "-" if t["measured"] is None else f"{t['measured']:.3f}" + (
            f" [{t['range'][0]:.2f}-{t['range'][1]:.2f}]" if t.get("range") else "")
        met = "-" if t["met"] is None else ("yes" if t["met"] else "**no**")
        rows.append(f"| {t['target']} | {v} | {t['goal']} | {met} |")
    return rows


def _commit(record: dict) -> str:
    return ((record.get("code") or {}).get("commit") or "?")[:7]


def before_after(before: dict, after: dict) -> str:
    """Two records of the same benchmark, the code before a change and after it: each model's words/s in both
    (runs of different hours: machine drift included), and sMLP-det's same-round ratio over gMLP in both, which
    cancels the drift that both sides share."""
    lines = [f"Before (commit {_commit(before)}) and after (commit {_commit(after)}), each its own run of "
             f"`python -m smlp_bench.speed`; words/s median [range] over rounds.", "",
             "| processes | model | words/s before | words/s after | after / before | sMLP-det over gMLP, before -> "
             "after |", "|---:|---|---:|---:|---:|---:|"]
    for n, side in (after.get("sides") or {}).items():
        old = (before.get("sides") or {}).get(n)
        if old is None:
            continue
        rows_was, rows_now = ({r["model"]: r for r in s["rows"]} for s in (old, side))
        for key, now in side["wps"].items():
            if key not in old["wps"]:
                continue
            was = old["wps"][key]
            ratio = f"{_cell(rows_was[key]['gMLP'])} -> {_cell(rows_now[key]['gMLP'])}" \
                if key in rows_was and key in rows_now else ""
            lines.append(f"| {n} | {NAMES.get(key, key)} | {was['median']:,.0f} [{was['range'][0]:,.0f}-"
                         f"{was['range'][1]:,.0f}] | {now['median']:,.0f} [{now['range'][0]:,.0f}-"
                         f"{now['range'][1]:,.0f}] | {now['median'] / was['median']:.3f}x | {ratio} |")
    return "\n".join(lines)


def _widths(speed: dict) -> dict[int, dict]:
    return {int(w): r for w, r in sorted(speed["widths"].items(), key=lambda kv: int(kv[0]))}


def _counts(speed: dict) -> list[int]:
    return sorted({int(n) for r in speed["widths"].values() for n in r["sides"]})


def _keys(speed: dict) -> list[str]:
    """Every model of the record, in the order measured (sMLP-det first)."""
    return list(dict.fromkeys(k for r in _widths(speed).values() for side in r["sides"].values()
                              for k in side["models"]))


def _over_gmlp(speed: dict, nproc: int, key: str) -> dict[int, dict]:
    """width -> a model's words/s over gMLP's on `nproc` processes (same rounds), where measured."""
    return {w: o for w, r in _widths(speed).items()
            if (o := ((r["sides"].get(str(nproc)) or {}).get("models", {}).get(key) or {}).get("gMLP"))}


def plot_widths(speed: dict, path: Path) -> Path:
    """One panel per process count: each model's words/s over gMLP's (median, range over rounds) against width."""
    plt, widths, counts = _pyplot(), list(_widths(speed)), _counts(speed)
    fig, axes = plt.subplots(1, len(counts), figsize=(6 * len(counts), 4.5), sharey=True, squeeze=False)
    names = {k: m["name"] for r in speed["widths"].values() for side in r["sides"].values()
             for k, m in side["models"].items()}
    for ax, n in zip(axes[0], counts):
        for i, key in enumerate(_keys(speed)):
            if not (pts := _over_gmlp(speed, n, key)):
                continue
            ws, rs = list(pts), list(pts.values())
            mid = [r["ratio"] for r in rs]
            ax.errorbar(ws, mid, yerr=[[m - r["lo"] for m, r in zip(mid, rs)], [r["hi"] - m for m, r in zip(mid, rs)]],
                        marker="o", capsize=3, label=names[key], color=plt.get_cmap("tab10")(i % 10),
                        lw=2.2 if key == "smlp_det" else 1.2)
        ax.axhline(1.0, color="gray", ls="--", lw=1, label="gMLP")
        ax.set_xscale("log", base=2)
        ax.set_xticks(widths, [str(w) for w in widths])
        ax.minorticks_off()
        ax.set(title=f"{n} process{'es' if n > 1 else ''}", xlabel="model width D (d_ffn = 4D)",
               ylabel="words/s over gMLP's (same round)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("training speed against width, each model FLOP-matched to sMLP-det at each width")
    fig.tight_layout()
    write_figure(path, fig, dpi=80)
    plt.close(fig)
    return path


def widths_markdown(speed: dict, figure: str | None = None) -> str:
    """The width section: how it was measured, the figure, sMLP-det's trend, every model's row (with the share of
    its tokens its experts processed), and the scaling at each width."""
    per = _widths(speed)
    s, m = speed["settings"], speed.get("machine") or {}
    t = s["target"]
    at = f" at commit {_commit(speed)}" if speed.get("code") else ""
    lines = [f"Measured by `smlp-bench speed --widths {','.join(map(str, per))}`{at} on "
             f"{m.get('cpu_model') or m.get('cpu', '?')}, gloo ranks x 1 thread, {s['updates']} updates x "
             f"{s['seeds']} interleaved round(s) per model, width and process count: the fair configuration "
             f"(T={t['seq_len']}, sMLP-det {t['dense']}+{t['sparse']} blocks, {t['experts']} experts) at d_model = D "
             f"and d_ffn = 4D, every model FLOP-matched to sMLP-det at each width by the calculator; "
             f"{'complete' if speed['complete'] else 'PARTIAL'}. Ratios from {speed['ratios_from']}: median [range] "
             f"over rounds. Tokens kept: the share of routing slots its experts processed in the measured intervals "
             f"(Switch and GShard drop tokens past capacity, the others keep every token), so that a speed that "
             f"comes from dropped tokens reads as such.", ""]
    if figure:
        lines += [f"![words/s over gMLP's against width, 1 process and 2 ranks]({figure})", ""]
    for n in _counts(speed):
        if pts := _over_gmlp(speed, n, "smlp_det"):
            lines.append(f"- sMLP-det's words/s over gMLP's, {n} process{'es' if n > 1 else ''}: "
                         + ", ".join(f"{_cell(r)} at D={w}" for w, r in pts.items()) + ".")
    lines += ["", "| D | processes | model | FLOPs / sMLP-det's | words/s [range] | over gMLP [range] | tokens kept |",
              "|---:|---:|---|---:|---:|---:|---:|"]
    for w, r in per.items():
        for n, side in r["sides"].items():
            ref = (side["models"].get("smlp_det") or {}).get("flops_per_token")
            for key, mm in side["models"].items():
                wps = side["wps"][key]
                flops = f"{mm['flops_per_token'] / ref:.3f}" if ref and mm.get("flops_per_token") else "-"
                kept = f"{mm['tokens_kept']:.1%}" if mm.get("tokens_kept") is not None else "-"
                lines.append(f"| {w} | {n} | {mm['name']} | {flops} | {wps['median']:,.0f} [{wps['range'][0]:,.0f}-"
                             f"{wps['range'][1]:,.0f}] | {_cell(mm['gMLP'])} | {kept} |")
    if scaled := [(w, r["scaling"]) for w, r in per.items() if r.get("scaling")]:
        keys = list(dict.fromkeys(k for _, sc in scaled for k in sc))
        lines += ["", "| scaling (words/s on 2 ranks / 2 x on 1 process) | " + " | ".join(NAMES.get(k, k) for k in keys)
                  + " |", "|---|" + "---:|" * len(keys)]
        lines += [f"| D={w} | " + " | ".join(f"{sc[k]:.2f}" if k in sc else "-" for k in keys) + " |"
                  for w, sc in scaled]
    widest = max(per)
    if parts := [(n, mm) for n, side in per[widest]["sides"].items() for mm in side["models"].values()
                 if mm.get("breakdown")]:
        lines += ["", f"Where a step goes at D={widest}: each range's share of the profiled steps' time (the "
                  "first round's run, mean over ranks; routing includes the auction; rest: what no range covers, the "
                  "dense projections, embeddings, loss, optimizer and data loading; smlp/profiling.py).", "",
                  "| processes | model | experts | token mixing | all2all | routing | rest | tokens kept |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for n, mm in parts:
            b, kept = mm["breakdown"], mm.get("tokens_kept")
            lines.append(f"| {n} | {mm['name']} | {b['experts']:.1%} | {b['token_mixing']:.1%} | {b['all2all']:.1%} | "
                         f"{b['routing'] + b.get('auction', 0.0):.1%} | {b['rest']:.1%} | "
                         f"{'-' if kept is None else f'{kept:.1%}'} |")
    lines += ["", "Goals: each width's own (issue 47's, the section above) and issue 53's; ratios are sMLP-det's "
              "words/s over the model's, same round, median [range] over rounds.", "",
              "| target | measured [range] | goal | met |", "|---|---:|---|---|", *_target_rows(speed["targets"])]
    return "\n".join(lines)


def widths_sentence(speed: dict) -> str:
    """README's speed sentence, from a record of several widths: sMLP-det's words/s over gMLP's at each width on
    1 process and on the most ranks, and the share of its routing slots Switch (which drops tokens) kept."""
    per, counts = _widths(speed), _counts(speed)

    def side(n: int, unit: str) -> str:
        ratios = ", ".join(f"{r['ratio']:.2f}x" for r in _over_gmlp(speed, n, "smlp_det").values())
        return f"{ratios}{unit} {'on one process' if n == 1 else f'on {n} CPU ranks'}"

    text = (f"Across widths (D={', '.join(map(str, per))}, FLOP-matched at each) sMLP-det trains at "
            + " and ".join(side(n, " gMLP's words/s" if i == 0 else "") for i, n in enumerate(counts)))
    kept = [((r["sides"].get(str(counts[-1])) or {}).get("models", {}).get("switch") or {}).get("tokens_kept")
            for r in per.values()]
    if all(k is not None for k in kept):
        text += (f"; Switch stays faster by dropping tokens past its capacity (it keeps "
                 f"{', '.join(f'{k:.0%}' for k in kept)} of them)")
    return text + " ([benchmarks.md](docs/benchmarks.md#speed-across-widths-issue-53))."


def publish(path: Path, page: Path = PAGE, before: Path | None = None) -> str:
    """Rewrite the section of `page` that the record at `path` feeds: the width section and its figure (a record of
    several widths), else the speed section (with the before/after table against the record at `before`). Returns
    what it rewrote."""
    speed = json.loads(Path(path).read_text())
    if "widths" in speed:
        if before is not None:
            raise BenchError(f"--before: {path} holds several widths; a before/after table compares records of one")
        figure = page.parent / WIDTHS_FIGURE
        figure.parent.mkdir(parents=True, exist_ok=True)
        text = replace_section(page.read_text(), WIDTHS_START, WIDTHS_END,
                               widths_markdown(speed, WIDTHS_FIGURE.as_posix()), page)
        plot_widths(speed, figure)
        write_text(page, text)
        return f"{page}: the width section and {figure} from {path}"
    text = markdown(speed) + (f"\n\n{before_after(json.loads(before.read_text()), speed)}" if before else "")
    write_text(page, replace_section(page.read_text(), START, END, text, page))
    return f"{page}: the speed section from {path}{f' against {before}' if before else ''}"
