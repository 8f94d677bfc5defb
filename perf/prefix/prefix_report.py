"""perf/prefix/bench_prefix.py's report: medians over runs per arm, workload and level; the issue's
targets checked; the tables (OUT.md) and the plot (OUT.png). Pure functions of the runs' rows, so
tests/perf/test_bench_prefix.py can check them on a scripted input.

A run is {"run", "arm": "SYSTEM:SHAPE:POLICY", "workload", "rows": [one summary per level]} with
the rows of perf.prefix.prefix_drive.summarize plus what perf.prefix.prefix_arms adds (CPU, counters).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

COLUMNS = [  # (key, header, format)
    ("rate", "offered req/s", "{:g}"), ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p90_ms", "p90", "{:.0f}"), ("ttft_p99_ms", "p99", "{:.0f}"),
    ("itl_p50_ms", "ITL p50 ms", "{:.1f}"), ("output_tok_s", "out tok/s", "{:.0f}"),
    ("hit_rate", "hit (usage)", "{:.2f}"), ("worker_hit_rate", "hit (workers)", "{:.2f}"),
    ("oracle_hit_rate", "oracle", "{:.2f}"), ("rate_503", "503 rate", "{:.3f}"),
    ("failed_other", "other fails", "{:.0f}"),
    ("cpu_us_per_req_frontend", "frontend CPU µs/req", "{:.0f}"),
    ("router_kv_us_per_req_placement", "kv placement µs/req", "{:.0f}"),
    ("router_kv_us_per_req_events", "kv events µs/req", "{:.0f}"),
    ("router_kv_us_per_req_total", "router µs/req (Dynamo)", "{:.0f}"),
]
UNIFORM_TOLERANCE = 0.10  # "no worse than least-loaded": within 10%, or the A/A spread if wider


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not math.isnan(float(v)) else None


def medians(runs: list[dict]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """(arm, workload, level) -> the median of each numeric figure over the runs, plus `runs`
    and the 503 count summed over the runs."""
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for r in runs:
        for row in r["rows"]:
            groups.setdefault((r["arm"], r["workload"], row["level"]), []).append(row)
    out = {}
    for key, rows in groups.items():
        m: dict[str, Any] = {"runs": len(rows), "rejected_503_sum":
                             sum(x.get("rejected_503", 0) for x in rows)}
        for k in {k for x in rows for k in x}:
            vals = [v for x in rows if (v := _num(x.get(k))) is not None]
            if vals:
                m[k] = statistics.median(vals)
        out[key] = m
    return out


def levels_of(med: dict, arm: str, workload: str) -> list[int]:
    return sorted(lv for (a, w, lv) in med if a == arm and w == workload)


def target_level(med: dict, rr: str, workload: str = "shared") -> tuple[int | None, str]:
    """The first level where round-robin's TTFT p50 is at least 3x its light-load (first level)
    value; else its highest level, said so."""
    lvls = levels_of(med, rr, workload)
    if not lvls:
        return None, f"no {rr} rows for {workload}"
    light = med[(rr, workload, lvls[0])].get("ttft_p50_ms")
    for lv in lvls:
        v = med[(rr, workload, lv)].get("ttft_p50_ms")
        if light and v is not None and v >= 3 * light:
            return lv, (f"level {lv} ({med[(rr, workload, lv)]['rate']:g} req/s): {rr} TTFT p50 "
                        f"{v:.0f} ms = {v / light:.1f}x its light-load {light:.0f} ms")
    lv = lvls[-1]
    v = med[(rr, workload, lv)].get("ttft_p50_ms") or float("nan")
    return lv, (f"{rr} never reached 3x its light-load TTFT p50 ({light:.0f} ms); its highest "
                f"level {lv} ({v:.0f} ms, {v / light:.1f}x) is used")


def _get(med: dict, arm: str, wl: str, lv: int | None, k: str) -> float | None:
    return None if lv is None else _num(med.get((arm, wl, lv), {}).get(k))


def _check(ok: bool | None, text: str) -> dict:
    return {"pass": ok, "text": text}


def targets(med: dict, shape: str, dynamo: bool = True) -> list[dict]:
    """The issue's targets for tandem's arms of one shape ("4agg", "2p2d")."""
    rr, kv, ll = (f"tandem:{shape}:{p}" for p in ("round-robin", "kv", "least-loaded"))
    out = []
    lv, why = target_level(med, rr)
    out.append(_check(None, f"target load: {why}"))
    a, b = _get(med, rr, "shared", lv, "ttft_p50_ms"), _get(med, kv, "shared", lv, "ttft_p50_ms")
    if a is None or b is None:
        out.append(_check(None, "kv TTFT p50 >= 3x better than round-robin: no data"))
    else:
        out.append(_check(a >= 3 * b, f"kv TTFT p50 {b:.0f} ms vs round-robin {a:.0f} ms: "
                                      f"{a / b:.1f}x better (target >= 3x)"))
    h, o = _get(med, kv, "shared", lv, "hit_rate"), _get(med, kv, "shared", lv, "oracle_hit_rate")
    if h is None or not o:
        out.append(_check(None, "kv hit rate >= 90% of oracle: no data"))
    else:
        worst = min((x for x in (_get(med, kv, "shared", v, "hit_rate") for v in
                                 levels_of(med, kv, "shared")) if x is not None), default=h)
        out.append(_check(h >= 0.9 * o, f"kv hit rate {h:.3f} vs oracle {o:.3f}: {h / o:.0%} "
                                        f"of oracle (target >= 90%; lowest kv level: {worst:.3f})"))
    worse, n = [], 0
    for wl in ("shared", "multiturn", "uniform"):
        for v in levels_of(med, kv, wl):
            k503 = med[(kv, wl, v)]["rejected_503_sum"]
            r503 = med.get((rr, wl, v), {}).get("rejected_503_sum")
            if r503 is None:
                continue
            n += 1
            if k503 > r503:
                worse.append(f"{wl} level {v}: {k503} vs {r503}")
    out.append(_check(not worse if n else None, "kv 503s <= round-robin's at every load "
                      f"({n} workload-levels): " + ("; ".join(worse) if worse else
                                                    "none more" if n else "no data")))
    out.append(uniform_check(med, shape, lv))
    if dynamo:
        out += dynamo_targets(med, shape, lv)
    return out


def uniform_check(med: dict, shape: str, lv: int | None) -> dict:
    """"No worse than least-loaded on the uniform control", at the target load: kv's TTFT p50
    within UNIFORM_TOLERANCE of least-loaded's, or within the spread between least-loaded and
    prefix if that is wider. On uniform traffic those two place every request alike (no block of
    a random prompt ever matches, so prefix falls back to least-loaded each time): their spread
    is what the same placement measures twice at that load. Every other level is listed too, as
    kv/least-loaded ratios (past saturation TTFT is queueing, and noisy)."""
    kv, ll, px = (f"tandem:{shape}:{p}" for p in ("kv", "least-loaded", "prefix"))
    ratios = []
    for v in levels_of(med, kv, "uniform"):
        a, b = _get(med, kv, "uniform", v, "ttft_p50_ms"), _get(med, ll, "uniform", v,
                                                                "ttft_p50_ms")
        if a is not None and b:
            ratios.append(f"{v}: {a / b:.2f}")
    a, b = _get(med, kv, "uniform", lv, "ttft_p50_ms"), _get(med, ll, "uniform", lv, "ttft_p50_ms")
    if a is None or not b:
        return _check(None, "uniform control: kv vs least-loaded at the target load: no data")
    c = _get(med, px, "uniform", lv, "ttft_p50_ms")
    spread = abs(c - b) / b if c is not None else 0.0
    tol = max(UNIFORM_TOLERANCE, spread)
    aa = f"least-loaded vs prefix (the same placement here) {spread:.0%} apart" if c is not None \
        else "no prefix arm to measure the spread"
    return _check(a <= (1 + tol) * b,
                  f"uniform control at level {lv}: kv TTFT p50 {a:.0f} vs least-loaded {b:.0f} ms "
                  f"({a / b:.2f}x; target <= {1 + tol:.2f}x: {UNIFORM_TOLERANCE:.0%} or the A/A "
                  f"spread, {aa}); kv/least-loaded by level: {', '.join(ratios)}")


def dynamo_targets(med: dict, shape: str, lv: int | None) -> list[dict]:
    kv, rr = f"tandem:{shape}:kv", f"tandem:{shape}:round-robin"
    dkv, drr = "dynamo:4agg:kv", "dynamo:4agg:round-robin"
    out = []
    for wl in ("shared", "multiturn"):
        t, d = _get(med, kv, wl, lv, "hit_rate"), _get(med, dkv, wl, lv, "hit_rate")
        out.append(_check(None if t is None or d is None else t >= d,
                          f"{wl}: tandem kv hit rate {_f(t)} vs Dynamo kv {_f(d)} at level {lv} "
                          "(target: tandem >= Dynamo)"))
    a, b = _get(med, rr, "shared", lv, "ttft_p50_ms"), _get(med, kv, "shared", lv, "ttft_p50_ms")
    c, d = _get(med, drr, "shared", lv, "ttft_p50_ms"), _get(med, dkv, "shared", lv,
                                                             "ttft_p50_ms")
    if None in (a, b, c, d):
        out.append(_check(None, "TTFT gain over own round-robin vs Dynamo's: no data"))
    else:
        assert a and b and c and d
        out.append(_check(a / b >= c / d, f"shared: tandem round-robin/kv TTFT p50 {a / b:.2f}x "
                                          f"vs Dynamo's {c / d:.2f}x ({c:.0f} / {d:.0f} ms) at "
                                          f"level {lv} (target: tandem >= Dynamo)"))
    return out


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def table(med: dict, arms: list[str], workload: str) -> list[str]:
    cols = [c for c in COLUMNS if any(c[0] in m for (a, w, _), m in med.items()
                                      if w == workload and a in arms)]
    lines = ["| arm | " + " | ".join(h for _, h, _ in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for arm in arms:
        for lv in levels_of(med, arm, workload):
            m = med[(arm, workload, lv)]
            cells = [fmt.format(m[k]) if _num(m.get(k)) is not None else "-"
                     for k, _, fmt in cols]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def markdown(runs: list[dict], header: list[str], skipped: list[str]) -> str:
    med = medians(runs)
    arms = sorted({r["arm"] for r in runs}, key=_arm_order)
    lines = [*header, ""]
    if skipped:
        lines += ["Not run:", "", *(f"- {s}" for s in skipped), ""]
    lines += ["## Targets", ""]
    for shape in sorted({a.split(":")[1] for a in arms if a.startswith("tandem:")}):
        lines += [f"### tandem {shape}", ""]
        for t in targets(med, shape, dynamo=shape == "4agg"):
            mark = {True: "PASS", False: "FAIL", None: "-"}[t["pass"]]
            lines.append(f"- {mark}: {t['text']}")
        lines.append("")
    for wl in ("shared", "multiturn", "uniform"):
        if not any(w == wl for (_, w, _) in med):
            continue
        lines += [f"## {wl} (medians of the runs)", "", *table(med, arms, wl), ""]
    return "\n".join(lines) + "\n"


def _arm_order(arm: str) -> tuple[int, str, int]:
    system, shape, policy = arm.split(":")
    order = ["round-robin", "least-loaded", "prefix", "kv"]
    return (system != "tandem", shape, order.index(policy) if policy in order else 9)


def plot(runs: list[dict]):  # -> matplotlib Figure
    """Per workload (rows): TTFT p50, cache hit rate and 503 rate against the offered load, one
    line per arm (medians of the runs)."""
    import matplotlib.pyplot as plt

    med = medians(runs)
    arms = sorted({r["arm"] for r in runs}, key=_arm_order)
    wls = [w for w in ("shared", "multiturn", "uniform") if any(x == w for (_, x, _) in med)]
    fig, axes = plt.subplots(len(wls), 3, figsize=(18, 4.5 * len(wls)), squeeze=False)
    for row, wl in zip(axes, wls):
        for arm in arms:
            lvls = levels_of(med, arm, wl)
            if not lvls:
                continue
            style = "-" if ":4agg:" in arm and arm.startswith("tandem") else \
                "--" if arm.startswith("tandem") else ":"
            xs = [med[(arm, wl, v)]["rate"] for v in lvls]
            for ax, key in zip(row, ("ttft_p50_ms", "hit_rate", "rate_503")):
                ax.plot(xs, [med[(arm, wl, v)].get(key, float("nan")) for v in lvls],
                        style, marker="o", label=arm)
        for ax, title in zip(row, ("TTFT p50 (ms)", "cache hit rate (usage)", "503 rate")):
            ax.set_title(f"{wl}: {title}")
            ax.set_xlabel("offered requests/s")
            ax.grid(True, alpha=0.3)
        row[0].set_yscale("log")
        row[0].legend(fontsize="x-small")
    fig.tight_layout()
    return fig
