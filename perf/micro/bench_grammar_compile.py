"""How long xgrammar 0.2.8 takes to compile a JSON schema, by size and shape: what the cap on a
schema's size (tandem.runtime.sampling.MAX_GRAMMAR_CHARS) is set from, against the compile
deadline (tandem.engines.grammars.COMPILE_DEADLINE_S).

Three shapes, each at several sizes (characters of the compact JSON): `nested`, objects nested in
objects (each level a few string and integer properties and one object property); `flat`, one
object with many properties; `distinct`, `nested` with a maxLength of its own on every string (a
rule each, which costs xgrammar a token mask each: the costly shape, as the attack's was). Each is compiled with the
compiler tandem's reference engine builds (the model's tokenizer; compact JSON, strict mode), in a
fresh compiler (no cache), `--runs` times; the figure is the median. It also times what a compile
process's answer costs the engine: serializing the compiled grammar and deserializing it.

    nice -n 19 .venv/bin/python perf/micro/bench_grammar_compile.py --model models/smollm2 --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


def nested(depth: int, width: int = 3) -> dict[str, Any]:
    props: dict[str, Any] = {f"s{i}": {"type": "string", "maxLength": 20} for i in range(width)}
    props["n"] = {"type": "integer", "minimum": 0, "maximum": 100}
    if depth > 0:
        props["child"] = nested(depth - 1, width)
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def distinct(depth: int) -> dict[str, Any]:
    """`nested`, but every string has a maxLength of its own: each is a rule of its own, which
    xgrammar builds a token mask for (the costly shape)."""
    k = 0

    def level(d: int) -> dict[str, Any]:
        nonlocal k
        props: dict[str, Any] = {}
        for i in range(3):
            k += 1
            props[f"s{i}"] = {"type": "string", "maxLength": 5 + k}
        if d:
            props["child"] = level(d - 1)
        return {"type": "object", "properties": props, "required": list(props),
                "additionalProperties": False}
    return level(depth)


def flat(n: int) -> dict[str, Any]:
    props = {f"field_{i}": ({"type": "string", "maxLength": 20} if i % 2 else
                            {"type": "integer", "minimum": 0, "maximum": 1000})
             for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/smollm2", help="a model directory (tokenizer)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--depths", type=int, nargs="*", default=[5, 10, 20, 40, 80])
    ap.add_argument("--widths", type=int, nargs="*", default=[25, 50, 100, 200, 400, 800])
    ap.add_argument("--distinct", type=int, nargs="*", default=[1, 2, 3, 5, 8, 12])
    ap.add_argument("--stop-after", type=float, default=30.0,
                    help="skip the larger sizes of a shape once one compile takes this long")
    args = ap.parse_args()
    import xgrammar

    from tandem.engines.reference.grammar import tokenizer_info

    cfg = json.loads((Path(args.model) / "config.json").read_text())
    info = tokenizer_info(xgrammar, Path(args.model), cfg["vocab_size"],
                          tuple(_eos(cfg)))
    print(f"model {args.model}: vocab {cfg['vocab_size']}")
    print("| shape | size | characters | compile s (median) | serialize ms | deserialize ms |")
    print("|---|---|---|---|---|---|")
    shapes = (("nested", args.depths, nested), ("flat", args.widths, flat),
              ("distinct", args.distinct, distinct))
    for shape, sizes, make in shapes:
        for size in sizes:
            text = json.dumps(make(size), separators=(",", ":"))
            times = []
            compiled: Any = None
            for _ in range(args.runs):
                compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                t0 = time.perf_counter()
                compiled = compiler.compile_json_schema(text, any_whitespace=False,
                                                        strict_mode=True)
                times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            blob = compiled.serialize_json()
            t1 = time.perf_counter()
            xgrammar.CompiledGrammar.deserialize_json(blob, info)
            t2 = time.perf_counter()
            med = statistics.median(times)
            print(f"| {shape} | {size} | {len(text)} | {med:.2f} | {(t1 - t0) * 1e3:.1f} | "
                  f"{(t2 - t1) * 1e3:.1f} |", flush=True)
            if med > args.stop_after:
                break


def _eos(cfg: dict[str, Any]) -> list[int]:
    eos = cfg.get("eos_token_id", [])
    return eos if isinstance(eos, list) else [eos]


if __name__ == "__main__":
    main()
