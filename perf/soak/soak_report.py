"""The soak's figures (perf.soak.soak): counts by kind, mismatches, failures inside and outside fault
windows, pages, RSS per process; the checks, written as OUT.json and OUT.md."""

from __future__ import annotations

import json
import os
import platform
import time
from collections import Counter
from typing import Any

RSS_LIMIT = 1.10  # the target: every process within 10% of its start after the load
MB = 1 << 20


def _window(r: Any, faults: list[Any]) -> int:
    """The index of the fault window the request overlaps (-1: none). A window is [kill, back];
    one never back lasts to the end."""
    for i, f in enumerate(faults):
        back = f.back if f.back is not None else float("inf")
        if r.started <= back and r.ended >= f.killed:
            return i
    return -1


def reference_facts(pool: list, refs: dict) -> dict:
    """What the fault-free answers hold: how choices finished, how many were compared with
    logprobs, so a report shows the mix exercised what it says."""
    finish: Counter = Counter()
    lp_tokens = choices = 0
    for b in pool:
        for text, reason, lps in refs[b.id]["choices"]:
            finish[f"{reason} ({'stop string' if b.stop else 'no stop'})"] += 1
            lp_tokens += len(lps)
            choices += 1
    return {"choices": choices, "finish_reasons": dict(finish), "logprob_entries": lp_tokens}


def summarize(*, cfg: Any, pool: list, records: list, faults: list, t0: float, load_s: float,
              ref_s: float, refs: dict, restarts: list, supervise_error: str, idle: bool,
              idle_s: float, rows: list, own: dict, rss_start: dict, rss_end: dict, samples: list,
              extra: dict) -> dict:
    bodies = {b.id: b for b in pool}
    last_back = max((f.back for f in faults if f.back is not None), default=None)
    all_back = len(faults) == len(cfg.fault_at) and all(f.back is not None for f in faults)
    by_kind: dict[str, Counter] = {}
    fail_in: Counter = Counter()
    fail_out: Counter = Counter()
    fail_after: Counter = Counter()
    examples: list[dict] = []
    seen: Counter = Counter()
    mismatches: list[dict] = []
    for r in records:
        w = _window(r, faults)
        for k in bodies[r.body].kinds:
            c = by_kind.setdefault(k, Counter())
            c["sent"] += 1
            c["failed" if r.kind else "completed"] += 1
            if r.mismatch:
                c["mismatched"] += 1
            if r.closed_early:
                c["left on purpose"] += 1
        if r.mismatch:
            mismatches.append({"body": r.body, "t": round(r.started - t0, 2), "window": w,
                               "why": r.mismatch})
        if not r.kind:
            continue
        where = "in" if w >= 0 else "out"
        (fail_in if w >= 0 else fail_out)[r.kind] += 1
        if last_back is not None and r.started > last_back:
            fail_after[r.kind] += 1
        seen[(w, r.kind)] += 1
        if seen[(w, r.kind)] <= 3 or where == "out":  # a few of each, every one outside
            examples.append({"body": r.body, "t": round(r.started - t0, 2), "window": w,
                             "kind": r.kind, "error": r.error[:300]})
    fault_rows = []
    for i, f in enumerate(faults):
        inside = [r for r in records if _window(r, faults) == i]
        fault_rows.append({
            "victim": f.name, "old_pid": f.old_pid, "new_pid": f.new_pid,
            "killed_at_s": round(f.killed - t0, 2),
            "back_at_s": None if f.back is None else round(f.back - t0, 2),
            "down_s": None if f.back is None else round(f.back - f.killed, 2),
            "requests_in_window": len(inside),
            "failed_in_window": sum(1 for r in inside if r.kind),
            "failures_by_kind": dict(Counter(r.kind for r in inside if r.kind))})
    killed = {(f.name, f.old_pid) for f in faults}
    unexpected = [{"name": r.name, "old_pid": r.old_pid, "new_pid": r.new_pid,
                   "at_s": round(r.at - t0, 2), "line": r.line}
                  for r in restarts if (r.name, r.old_pid) not in killed]
    pages = [{k: w.get(k) for k in ("name", "role", "state", "placed", "pages_free",
                                    "pages_total", "pages_reserved", "running", "waiting",
                                    "in_flight", "host_pages_cached", "prefix_cache_host_hits")}
             for w in rows]
    leaked = sum((w["pages_total"] - w["pages_free"]) + (w["pages_reserved"] or 0)
                 for w in rows) if rows else None
    rss = _rss_table(rss_start, rss_end, faults, samples)
    completed = sum(1 for r in records if not r.kind)
    checks = {
        "every fault killed and back": all_back,
        "no restart the soak did not cause": not unexpected and not supervise_error,
        "no mismatch": not mismatches,
        "no failure outside fault windows": not fail_out,
        "no failure after the last restart came back": all_back and not fail_after,
        # (the frontend restarted last: what it placed, it placed after the last restart)
        "every worker took requests after the last restart":
            len(rows) == 3 and all(w.get("placed", 0) > 0 for w in rows),
        "idle at the end, zero pages leaked": bool(idle and leaked == 0),
        f"RSS of every process within {RSS_LIMIT - 1:.0%} of its start":
            bool(rss) and all(x["ratio"] is not None and x["ratio"] <= RSS_LIMIT for x in rss),
    }
    return {
        "command": "python perf/soak/soak.py " + " ".join(cfg.argv),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                 "python": platform.python_version(), "niceness": os.nice(0)},
        "config": {k: v for k, v in vars(cfg).items() if k not in ("argv", "write")},
        "reference": {"bodies": len(pool), "seconds": round(ref_s, 1),
                      "pool_kinds": dict(Counter(k for b in pool for k in b.kinds)),
                      **reference_facts(pool, refs)},
        "load_seconds": round(load_s, 1),
        "requests": {"sent": len(records), "completed": completed,
                     "failed": len(records) - completed,
                     "left_on_purpose": sum(1 for r in records if r.closed_early),
                     "compared_in_full": sum(1 for r in records if not r.kind
                                             and not r.closed_early),
                     "compared_as_prefix": sum(1 for r in records if not r.kind
                                               and r.closed_early)},
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "mismatches": len(mismatches), "mismatch_examples": mismatches[:20],
        "faults": fault_rows,
        "failures": {"in_fault_windows": sum(fail_in.values()),
                     "outside_fault_windows": sum(fail_out.values()),
                     "after_last_restart": sum(fail_after.values()),
                     "in_by_kind": dict(fail_in), "outside_by_kind": dict(fail_out),
                     "examples": examples[:40]},
        "unexpected_restarts": unexpected, "supervise_error": supervise_error,
        "pages": {"idle": idle, "waited_s": round(idle_s, 2), "leaked": leaked,
                  "workers": pages, "worker_requests_in_flight": own},
        "rss": rss, "rss_samples": samples, "migrations": extra,
        "checks": checks, "passed": all(checks.values()),
    }


def _rss_table(start: dict, end: dict, faults: list, samples: list) -> list[dict]:
    """Per process: its start (idle, after the fault-free warm-up run) and its RSS once idle
    after the load. A restarted process is compared with the start of the process it replaced
    (same role and load); its own first reading, when it came back, is shown beside it."""
    out = []
    back = {f.name: f for f in faults}
    for name, e in sorted(end.items()):
        s = start.get(name)
        peak = max((x[1][name]["rss"] for x in samples
                    if name in x[1] and x[1][name]["pid"] == e["pid"]), default=e["rss"])
        row = {"process": name, "pid_start": s and s["pid"], "pid_end": e["pid"],
               "restarted": bool(s and s["pid"] != e["pid"]),
               "start_mb": s and round(s["rss"] / MB, 1), "end_mb": round(e["rss"] / MB, 1),
               "peak_mb": round(peak / MB, 1),
               "ratio": round(e["rss"] / s["rss"], 3) if s else None}
        f = back.get(name)
        if row["restarted"] and f is not None and f.rss_at_back:
            row["at_restart_mb"] = round(f.rss_at_back / MB, 1)
            row["ratio_to_restart"] = round(e["rss"] / f.rss_at_back, 3)
        out.append(row)
    return out


def verdict(res: dict) -> str:
    lines = [f"soak: {'PASSED' if res['passed'] else 'FAILED'}"]
    lines += [f"  [{'x' if ok else ' '}] {what}" for what, ok in res["checks"].items()]
    return "\n".join(lines)


def write(res: dict, out: str) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(out + ".md", "w") as f:
        f.write(markdown(res))


def _pace(cfg: dict) -> str:
    if cfg["engine"] != "mock":
        return ""
    return (f", mock engine at {cfg['decode_step_us']} µs a decode step and "
            f"{cfg['prefill_us_per_token']} µs a prompt token")


def _how(res: dict) -> str:
    tol = res.get("logprob_tolerance")
    return "exactly" if not tol else f"within {tol:g}"


def markdown(res: dict) -> str:
    q, fl, pg = res["requests"], res["failures"], res["pages"]
    cfg = res["config"]
    md = [f"# Soak: 1P2D, {cfg['engine']} engine, {res['load_seconds']:g} s of load, each role "
          "killed and restarted once", "",
          f"Command: `{res['command']}` ({res['when']}; {res['host']['cpus']} CPUs, niceness "
          f"{res['host']['niceness']}; {res['host']['platform']}). Concurrency "
          f"{cfg['concurrency']}, a pool of {res['reference']['bodies']} bodies (seed "
          f"{cfg['seed']}){_pace(cfg)}. The reference: each body "
          f"once, fault-free, before any kill ({res['reference']['seconds']} s): "
          f"{res['reference']['choices']} choices, finish reasons "
          f"{res['reference']['finish_reasons']}, {res['reference']['logprob_entries']} "
          f"logprob entries. Compared: text, finish_reason and usage exactly; logprob entries "
          f"(token, bytes, top alternatives) exactly, their values {_how(res)}.",
          "",
          "## Checks", "", *(f"- {'PASS' if ok else 'FAIL'}: {what}"
                             for what, ok in res["checks"].items()), "",
          "## Requests", "",
          f"{q['sent']} sent: {q['completed']} completed ({q['compared_in_full']} compared in full "
          f"with the reference, {q['compared_as_prefix']} left on purpose mid-stream and "
          f"compared as a prefix), {q['failed']} failed. Mismatches: **{res['mismatches']}**.", "",
          "| kind | sent | completed | failed | mismatched | left on purpose |",
          "|---|---:|---:|---:|---:|---:|"]
    for k, c in res["by_kind"].items():
        md.append(f"| {k} | {c.get('sent', 0)} | {c.get('completed', 0)} | {c.get('failed', 0)} "
                  f"| {c.get('mismatched', 0)} | {c.get('left on purpose', 0)} |")
    md += ["", "## Faults", "",
           "| victim | killed at | back at | down | requests overlapping | failed | how |",
           "|---|---:|---:|---:|---:|---:|---|"]
    for f in res["faults"]:
        md.append(f"| {f['victim']} (pid {f['old_pid']} -> {f['new_pid']}) | {f['killed_at_s']} s "
                  f"| {f['back_at_s']} s | {f['down_s']} s | {f['requests_in_window']} | "
                  f"{f['failed_in_window']} | {f['failures_by_kind'] or '-'} |")
    md += ["", f"Failures inside fault windows: {fl['in_fault_windows']}; outside them: "
           f"**{fl['outside_fault_windows']}**; after the last restart came back: "
           f"**{fl['after_last_restart']}**. Unexpected restarts: "
           f"{len(res['unexpected_restarts'])}. Migrations counted by the frontend: "
           f"{res['migrations']}.", ""]
    md += ["## Pages", "", f"Idle {pg['waited_s']} s after the load: {pg['idle']}; pages leaked: "
           f"**{pg['leaked']}**; each worker's own requests in flight: "
           f"{pg['worker_requests_in_flight']}.", "",
           "| worker | state | placed since the last restart | pages free / total | reserved | "
           "running | waiting | in flight |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for w in pg["workers"]:
        md.append(f"| {w['name']} | {w['state']} | {w['placed']} | "
                  f"{w['pages_free']} / {w['pages_total']} | "
                  f"{w['pages_reserved']} | {w['running']} | {w['waiting']} | {w['in_flight']} |")
    md += ["", "## RSS", "",
           "Start: idle after the fault-free reference run. End: idle after the load. A restarted "
           "process is compared with the start of the process it replaced; its own first reading "
           "(when it came back, before it had served) is beside it.", "",
           "| process | pid start -> end | start MB | end MB | peak MB | end / start | "
           "at restart MB | end / at restart |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["rss"]:
        md.append(f"| {r['process']} | {r['pid_start']} -> {r['pid_end']} | {r['start_mb']} | "
                  f"{r['end_mb']} | {r['peak_mb']} | {r['ratio']} | {r.get('at_restart_mb', '-')}"
                  f" | {r.get('ratio_to_restart', '-')} |")
    if fl["examples"]:
        md += ["", "## Failures (first ones)", ""]
        md += [f"- t={e['t']} s, window {e['window']}, {e['kind']}: {e['error'][:160]}"
               for e in fl["examples"][:15]]
    if res["mismatch_examples"]:
        md += ["", "## Mismatches (first ones)", ""]
        md += [f"- body {m['body']} at t={m['t']} s: {m['why']}" for m in res["mismatch_examples"]]
    return "\n".join(md) + "\n"
