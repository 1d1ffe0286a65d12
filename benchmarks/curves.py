"""Validation curves: the mean over seeds, where two curves cross, and when the ranking settles. A curve is
validation perplexity at increasing x (tokens read, or seconds), compared in log perplexity, linearly interpolated
between validation points; two curves cross where their difference changes sign inside the x range both cover."""
from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence


def mean_curve(curves: Sequence[dict], xkey: str) -> tuple[list[float], list[float]]:
    """Mean x and geometric-mean perplexity over seeds, point by point (as many points as the shortest curve)."""
    curves = [c for c in curves if c.get("ppl") and c.get(xkey)]  # no time axis without a measured speed
    if not curves:
        return [], []
    n = min(min(len(c["ppl"]), len(c[xkey])) for c in curves)
    return ([statistics.mean(c[xkey][i] for c in curves) for i in range(n)],
            [math.exp(statistics.mean(math.log(c["ppl"][i]) for c in curves)) for i in range(n)])


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Linear interpolation of log y at x (xs increasing, x inside [xs[0], xs[-1]])."""
    if (i := bisect.bisect_left(xs, x)) < len(xs) and xs[i] == x:
        return math.log(ys[i])
    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return (1 - t) * math.log(ys[i - 1]) + t * math.log(ys[i])


def crossings(xa: Sequence[float], ya: Sequence[float], xb: Sequence[float], yb: Sequence[float]) -> list[dict]:
    """Where curve a and curve b cross: [{x, ppl, lower_after: 'a' | 'b'}], in increasing x: a sign change of log
    ppl_a - log ppl_b between two neighbouring x of the union of their points (a touch is no crossing)."""
    if len(xa) < 2 or len(xb) < 2:
        return []
    lo, hi = max(xa[0], xb[0]), min(xa[-1], xb[-1])
    grid = sorted({x for x in (*xa, *xb) if lo <= x <= hi})
    out, prev = [], None
    for x in grid if len(grid) >= 2 else []:
        d = _interp(xa, ya, x) - _interp(xb, yb, x)
        if d == 0:
            continue
        if prev is not None and (prev[0] < 0) != (d < 0):
            d0, x0 = prev
            xc = x0 + (x - x0) * d0 / (d0 - d)
            out.append({"x": xc, "ppl": math.exp(_interp(xa, ya, xc)), "lower_after": "b" if d > 0 else "a"})
        prev = (d, x)
    return out


def ranking_history(curves: dict[str, tuple[Sequence[float], Sequence[float]]]) -> list[dict]:
    """The ranking (lowest perplexity first) at every validation point all curves share (by index), with each
    model's perplexity there."""
    n = min((len(ys) for _, ys in curves.values()), default=0)
    return [{"x": statistics.mean(curves[k][0][i] for k in curves),
             "ranking": sorted(curves, key=lambda k: curves[k][1][i]), "ppl": {k: curves[k][1][i] for k in curves}}
            for i in range(n)]


def settled_from(history: Sequence[dict], top: int | None = None, tol: float = 0.0) -> dict | None:
    """The first validation point from which the ranking (its first `top` places) no longer changes, two models
    within `tol` (relative perplexity) of each other counting as tied: {x, index, points_unchanged, fraction,
    tolerance}, fraction = x / the last x; None for no history."""
    if not history:
        return None
    final = history[-1]["ranking"]
    top = top or len(final)

    def agrees(point: dict) -> bool:  # keeps the final ranking's first `top` places, each above everyone after it
        return all(point["ppl"][a] <= point["ppl"][b] * (1 + tol) for i, a in enumerate(final[:top])
                   for b in final[i + 1:])

    i = len(history) - 1
    while i > 0 and agrees(history[i - 1]):
        i -= 1
    return {"x": history[i]["x"], "index": i, "points_unchanged": len(history) - i,
            "fraction": history[i]["x"] / history[-1]["x"] if history[-1]["x"] else None, "tolerance": tol}
