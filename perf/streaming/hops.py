"""Where requests' first tokens waited: the request timelines of a run
(`TANDEM_TIMELINE=DIR`, tandem.runtime.timeline) joined into one row per request, a hop per
column (README, "Request timelines").

    python perf/streaming/hops.py DIR [--tenant T] [--client FILE] [--slowest 20]

Hops of a request's first token, in milliseconds:

- `http`: the client sent it -> the frontend read its body and opened it (with `--client`);
- `admit`: -> admitted and sent to a worker (the frontend's queue and page gate);
- `to_worker`: -> the worker read its Generate;
- `wait`: -> a step began computing its prompt (the step in progress, and any it was not taken
  into); `waited` counts the steps that began meanwhile;
- `compute`: that step's start -> the end of the step that computed its prompt's last token (one
  step, or several for a prompt chunked across steps); `prefill_tokens` and `decodes` are the
  first such step's whole batch (how much of another request's work it carried);
- `out`: -> its first output left the worker; `first`: -> its delta reached the response;
- `held`: -> its first bytes for the client were made (a token whose text is not whole yet makes
  none: the next step's token completes it);
- `to_client`: -> the client read them (with `--client`);
- `ttft`: the whole (the client's own, with `--client`; else from the frontend's arrival);
- `gc`: how long garbage collections stopped the frontend or a worker within it (the longest
  process's total).

`--client FILE` names the client's own times, one line per request: `T0 T1 RID` (CLOCK_MONOTONIC
seconds, as `time.perf_counter` on Linux: sent, first chunk read).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from perf.common.stats import quantile  # noqa: E402

HOPS = ("http", "admit", "to_worker", "wait", "waited", "compute", "prefill_tokens", "decodes",
        "out", "first", "held", "to_client", "ttft", "gc")


@dataclass
class Step:
    start: float
    end: float
    prefill_tokens: int
    decodes: int
    worker: int  # (which process's)


@dataclass
class Timeline:
    events: dict[str, dict[str, float]] = field(default_factory=dict)  # rid -> event -> time
    tenants: dict[str, str] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)  # every worker's, by start
    gcs: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # process -> pauses
    prompt_steps: dict[str, list[int]] = field(default_factory=dict)  # rid -> its steps' indices


def read(directory: str) -> Timeline:
    """Every `*.tl` file of `directory` (one per process)."""
    tl = Timeline()
    listed: list[tuple[Step, list[str]]] = []
    for n, path in enumerate(sorted(glob.glob(os.path.join(directory, "*.tl")))):
        begun: tuple[float, int, int, list[str]] | None = None
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 2:
                    continue  # (a line cut short by the process's end)
                t, event = float(parts[0]), parts[1]
                if event == "step":
                    begun = (t, int(parts[2]), int(parts[3]), parts[4:])
                elif event == "gc":
                    tl.gcs.setdefault(n, []).append((t - float(parts[3]) / 1e3, t))
                elif event == "end":
                    if begun is not None:
                        listed.append((Step(begun[0], t, begun[1], begun[2], n), begun[3]))
                    begun = None
                elif len(parts) >= 3:
                    seen = tl.events.setdefault(parts[2], {})
                    seen.setdefault(event, t)
                    if event == "arrive" and len(parts) >= 5:
                        tl.tenants[parts[2]] = parts[3]
                        seen.setdefault("t0", float(parts[4]))
    listed.sort(key=lambda x: x[0].start)
    for i, (step, rids) in enumerate(listed):
        tl.steps.append(step)
        for rid in rids:
            tl.prompt_steps.setdefault(rid, []).append(i)
    return tl


def hops(tl: Timeline, rid: str, client: tuple[float, float] | None = None
         ) -> dict[str, float] | None:
    """One request's hops (ms; `waited`, `prefill_tokens` and `decodes` are counts), or None
    when its timeline lacks an event (it failed, or the run ended first)."""
    e = tl.events.get(rid, {})
    need = ("t0", "arrive", "placed", "recv", "out", "first", "chunk")
    if any(k not in e for k in need):
        return None
    row: dict[str, float] = {}
    ms = 1e3
    row["http"] = (e["arrive"] - client[0]) * ms if client else float("nan")
    row["admit"] = (e["placed"] - e["arrive"]) * ms
    row["to_worker"] = (e["recv"] - e["placed"]) * ms
    mine = tl.prompt_steps.get(rid)
    if mine:  # (a PD decode worker computes no prompt: no step of its own)
        first, last = tl.steps[mine[0]], tl.steps[mine[-1]]
        row["wait"] = (first.start - e["recv"]) * ms
        row["waited"] = float(sum(1 for s in tl.steps[:mine[0]]
                                  if s.worker == first.worker and s.start > e["recv"]))
        row["compute"] = (last.end - first.start) * ms
        row["prefill_tokens"], row["decodes"] = float(first.prefill_tokens), float(first.decodes)
        row["out"] = (e["out"] - last.end) * ms
    else:
        row["wait"] = row["waited"] = row["compute"] = float("nan")
        row["prefill_tokens"] = row["decodes"] = float("nan")
        row["out"] = (e["out"] - e["recv"]) * ms
    row["first"] = (e["first"] - e["out"]) * ms
    row["held"] = (e["chunk"] - e["first"]) * ms
    row["to_client"] = (client[1] - e["chunk"]) * ms if client else float("nan")
    row["ttft"] = ((client[1] - client[0]) if client else (e["chunk"] - e["t0"])) * ms
    t0, t1 = e["t0"], e["chunk"]
    row["gc"] = max((sum(min(t1, b) - max(t0, a) for a, b in pauses if a < t1 and b > t0)
                     for pauses in tl.gcs.values()), default=0.0) * ms
    return row


def client_times(lines: Iterable[str]) -> dict[str, tuple[float, float]]:
    """A client's lines of `T0 T1 RID`, by rid."""
    out: dict[str, tuple[float, float]] = {}
    for line in lines:
        t0, t1, rid = line.split()
        out[rid] = (float(t0), float(t1))
    return out


def read_client(path: str) -> dict[str, tuple[float, float]]:
    with open(path) as f:
        return client_times(f)


def rows(tl: Timeline, rids: list[str] | None = None,
         client: dict[str, tuple[float, float]] | None = None) -> list[dict[str, Any]]:
    """Every request's hops (those of `rids`, in that order, when given), each with its rid."""
    out = []
    for rid in rids if rids is not None else sorted(tl.events):
        row = hops(tl, rid, client.get(rid) if client else None)
        if row is not None:
            out.append({"rid": rid, **row})
    return out


def summary(table: list[dict[str, Any]], ps: tuple[float, ...] = (0.5, 0.9, 0.99, 1.0)
            ) -> dict[str, dict[str, float]]:
    """Each hop's quantiles over `table` (1.0: the largest)."""
    return {h: {f"p{round(p * 100)}": round(quantile([r[h] for r in table], p), 2) for p in ps}
            for h in HOPS}


def render(table: list[dict[str, Any]], slowest: int) -> str:
    lines = ["| hop | " + " | ".join(f"p{round(p * 100)}" for p in (0.5, 0.9, 0.99, 1.0))
             + " |", "|---|---|---|---|---|"]
    for hop, qs in summary(table).items():
        lines.append(f"| {hop} | " + " | ".join(f"{v:.1f}" for v in qs.values()) + " |")
    if slowest:
        lines += ["", f"The {slowest} slowest (ms; counts for waited, prefill_tokens, decodes):",
                  "", "| rid | " + " | ".join(HOPS) + " |", "|---" * (len(HOPS) + 1) + "|"]
        for r in sorted(table, key=lambda r: r["ttft"])[-slowest:]:
            lines.append(f"| {r['rid'][:10]} | " + " | ".join(f"{r[h]:.1f}" for h in HOPS)
                         + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", help="the TANDEM_TIMELINE directory of a run")
    ap.add_argument("--tenant", default="", help="only this tenant's requests (its digest, as "
                    "the frontend's `arrive` lines name it)")
    ap.add_argument("--client", default="", help="the client's times: lines of T0 T1 RID")
    ap.add_argument("--slowest", type=int, default=20, help="list this many slowest requests")
    args = ap.parse_args()
    tl = read(args.directory)
    client = read_client(args.client) if args.client else None
    rids = list(client) if client else None
    table = rows(tl, rids, client)
    if args.tenant:
        table = [r for r in table if tl.tenants.get(r["rid"]) == args.tenant]
    print(f"{len(table)} requests, {len(tl.steps)} steps")
    print(render(table, args.slowest))


if __name__ == "__main__":
    main()
