"""Constrained output survives a migration, with real processes: a JSON-schema stream on one of
two reference workers, that worker SIGKILLed once the client holds the stream's first token (the
stream has 1,200 tokens to go: it is mid-way), and the stream completes on the other worker
within the grammar: its text equals a fault-free run's, token for token (the engines resume the
grammar from the earlier leg's tokens, and seeded draws are keyed by position), and the move is
counted."""

from __future__ import annotations

import json
import re

import pytest

from tests.cluster import Cluster
from tests.fault.test_migration import migrations
from tests.fault.test_pd_faults import assert_survivors_idle
from tests.sse import Stream

pytest.importorskip("xgrammar")

MAX_TOKENS = 1200
# An array no output of MAX_TOKENS tokens can end: every token is constrained to the end.
SCHEMA = {"type": "array", "minItems": 100000,
          "items": {"type": "integer", "minimum": 0, "maximum": 999}}
PREFIX = re.compile(r"\[(?:(?:0|[1-9][0-9]{0,2}), )*(?:0|[1-9][0-9]{0,2})?,? ?")


def body(model: str) -> dict:
    return {"model": model, "prompt": "Numbers:", "max_tokens": MAX_TOKENS, "temperature": 1.0,
            "seed": 11, "stream": True, "stream_options": {"include_usage": True},
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "numbers", "schema": SCHEMA}}}


def test_a_constrained_stream_moves_and_stays_within_its_grammar(tiny_model, tmp_path):
    c = Cluster(tiny_model, str(tmp_path))
    for _ in range(2):
        c.add_worker("reference")
    c.start_frontend()
    try:
        model = c.get_json("/v1/models")["data"][0]["id"]
        clean = Stream(c.url, "/v1/completions", body(model), timeout=120).read_all()
        assert clean.finish_reason == "length" and PREFIX.fullmatch(clean.text), clean.text[:80]
        s = Stream(c.url, "/v1/completions", body(model), timeout=120)
        assert s.next_event() is not None  # its first token: the stream is under way
        (victim,) = [w for w in c.workers
                     if {x["address"]: x for x in c.worker_states()}[w.address]["in_flight"]]
        victim.kill()
        moved = s.read_all()
        assert moved.status == 200 and moved.done and moved.error is None, moved.error
        usage = [e["usage"] for e in moved.events if e.get("usage")]
        assert usage[-1]["completion_tokens"] == MAX_TOKENS  # no token lost, none twice
        assert moved.text == clean.text
        assert migrations(c) >= 1
        assert_survivors_idle(c, [victim])
        json.loads(moved.text.rstrip(", ") + "]")  # (closed, it is the array the schema asks)
    finally:
        c.stop()
