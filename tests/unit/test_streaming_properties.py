"""End to end through the real pieces, in one process: engine outputs (cumulative, handed as the
SAME live list growing as SGLang does, or incremental; chunked at random) -> worker DeltaMaker ->
Delta messages (optionally through the wire encoding) -> the router's WorkerLink and
RequestHandle of a real WorkerPool (offsets checked, deltas merged while the reader lags) -> the
HTTP app (detokenizer, stop strings, stream_interval, one or several choices) -> the SSE bytes.
What the client reassembles must be exactly the engine's output, on both routes a token takes to
the client: the server's ASGI `send` (the task), and the calls tandem's uvicorn protocol offers
beside it (`body_nowait`, `start_nowait`: the route production takes), here over a server that
takes or refuses each write at random (a refused one is a slow client: the task writes it).

Only the worker is faked: it sits at the other end of an in-memory channel (through the wire
encoding), and answers each Generate it receives with that request's deltas, one message per loop
pass.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.engines.base import EngineOutput
from tandem.frontend.app import FrontendApp
from tandem.frontend.preprocess import Preprocessor
from tandem.frontend.uvicorn_protocol import EXTENSIONS
from tandem.router.request import RequestHandle
from tandem.runtime import wire
from tandem.config import FrontendConfig
from tandem.runtime.metrics import Registry
from tandem.runtime.wire import Delta, Deltas, SamplingParams
from tandem.worker.deltas import DeltaMaker
from tests.fakes import MULTILINGUAL_CORPUS, memory_pool, write_model_dir

ALPHABET = sorted(set("".join(MULTILINGUAL_CORPUS[:3])))


@pytest.fixture(scope="module")
def pre(tmp_path_factory: pytest.TempPathFactory) -> Preprocessor:
    return Preprocessor(write_model_dir(tmp_path_factory.mktemp("props") / "tiny"), "tiny")


def engine_outputs(ids: list[int], cuts: list[int], cumulative: bool,
                   lookahead: list[bool]) -> list[tuple[EngineOutput, list[int]]]:
    """The engine's outputs for `ids` split at `cuts`, the last one finished ("length"). In
    cumulative mode every output holds the same list, which may already have grown by the next
    chunk (`lookahead`) by the time the handler reads it — as SGLang's live list does. Each output
    comes with the list as it must be when the handler reads that output."""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(ids))), len(ids)]
    live: list[int] = []
    plan: list[tuple[EngineOutput, list[int]]] = []
    for k in range(len(bounds) - 1):
        lo, hi = bounds[k], bounds[k + 1]
        fin = "length" if k == len(bounds) - 2 else None
        if cumulative:
            ahead = bounds[k + 2] if lookahead[k % len(lookahead)] and k + 2 < len(bounds) else hi
            plan.append((EngineOutput("r", live, fin, prompt_tokens=3,  # type: ignore[arg-type]
                                      completion_tokens=hi), ids[:ahead]))
        else:
            plan.append((EngineOutput("r", ids[lo:hi], fin, prompt_tokens=3,  # type: ignore[arg-type]
                                      completion_tokens=hi), []))
    return plan


def worker_deltas(rid: str, plan: list[tuple[EngineOutput, list[int]]], cumulative: bool,
                  through_wire: bool) -> list[Delta]:
    maker = DeltaMaker(rid, "cumulative" if cumulative else "incremental")
    out: list[Delta] = []
    for o, live_now in plan:
        if cumulative:
            o.output_ids[len(o.output_ids):] = live_now[len(o.output_ids):]  # the list grows
        d = maker.make(o)
        if d is not None:
            out.append(d)
    if through_wire:
        msg = wire.TO_FRONTEND.decode(wire.encode(Deltas(out)))
        assert isinstance(msg, Deltas)
        out = msg.items
    return out


class Harness:
    """A real WorkerPool of one worker over an in-memory channel, and the worker's end played by a
    task: each Generate it receives is answered with the deltas `make(rid)` gives, one `Deltas`
    message per loop pass. `sent` is everything the frontend sent the worker."""

    def __init__(self) -> None:
        self.pool, self.workers = memory_pool(["agg"], pages=64, page_size=16,
                                              max_context=100_000)
        self.link = self.pool.links[0]
        self.end = self.workers.ends[self.link.address]
        self.streams: list[RequestHandle] = []
        self.sent: list[Any] = []
        self.make: Any = None
        self._task: asyncio.Task[None] | None = None

    @property
    def registry(self) -> Registry:
        return self.pool.registry

    @property
    def max_context(self) -> int | None:
        return self.pool.max_context

    def ready(self) -> bool:
        return True

    async def snapshot(self) -> list[dict[str, Any]]:
        return []

    def metrics(self) -> str:
        return self.pool.registry.render()

    def open(self, prompt_ids: list[int], sampling: SamplingParams, session: str = "",
             tenant: str = "", priority: int = 0, salt: str = "") -> RequestHandle:
        h = self.pool.open(prompt_ids, sampling, session, tenant, priority, salt)
        self.streams.append(h)
        return h

    async def start(self) -> None:
        await self.pool.start()
        self._task = asyncio.create_task(self._worker())

    async def close(self) -> None:
        await self.pool.close()
        if self._task is not None:
            if self._task.done():
                self._task.result()  # the fake worker failed: say why
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sent += self.end.received()  # what it had not read yet

    async def _worker(self) -> None:
        async for msg in self.end:
            self.sent.append(msg)
            if isinstance(msg, wire.Generates):
                for g in msg.items:
                    for d in self.make(g.rid):
                        self.end.send_nowait(Deltas([d]))
                        await asyncio.sleep(0)


def parse_sse(body: str) -> list[Any]:
    assert body.endswith("\n\n")
    out = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: ")
        data = block[6:]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def first_stop(full: str, stops: list[str]) -> tuple[int, int] | None:
    """Where the first stop string (the one whose occurrence ends first; ties: the longer) ends,
    and minus its length; None if none occurs."""
    best: tuple[int, int] | None = None
    for s in stops:
        i = full.find(s)
        if i >= 0:
            key = (i + len(s), -len(s))
            if best is None or key < best:
                best = key
    return best


def expected_text(full: str, stops: list[str]) -> tuple[str, str]:
    """The text cut before the first stop string, and the finish reason."""
    best = first_stop(full, stops)
    if best is None:
        return full, "length"
    end, neg = best
    return full[:end + neg], "stop"


def tokens_given(pre: Preprocessor, ids: list[int], full: str, stops: list[str]) -> int:
    """The tokens a client is given: all, or those to the one that completes the stop string."""
    best = first_stop(full, stops)
    if best is None:
        return len(ids)
    return next(n for n in range(len(ids) + 1)
                if pre.tokenizer.decode(ids[:n]).startswith(full[:best[0]]))


class NowCalls:
    """The server's calls beside ASGI over httpx's ASGI transport, whose `send` never awaits: a
    call writes through it at once (stepping its coroutine), in order with the app's own sends.
    `accept` says, in turn, whether the server can take each call's write now."""

    def __init__(self, send: Any, accept: list[bool]) -> None:
        self.send, self.accept, self.asked = send, accept, 0
        self.started = False
        self.written = 0  # writes made through these calls

    def _now(self, message: dict[str, Any]) -> None:
        step = self.send(message)
        try:
            step.send(None)
        except StopIteration:
            return
        step.close()
        raise AssertionError("the transport's send awaited")

    def _take(self) -> bool:
        self.asked += 1
        return self.accept[(self.asked - 1) % len(self.accept)]

    def body_nowait(self, data: bytes) -> bool:
        if not self.started or not data or not self._take():
            return False
        self._now({"type": "http.response.body", "body": data, "more_body": True})
        self.written += 1
        return True

    def start_nowait(self, status: int, headers: Any, body: bytes) -> bool:
        if self.started or not body or not self._take():
            return False
        self.started = True
        self._now({"type": "http.response.start", "status": status, "headers": headers})
        self._now({"type": "http.response.body", "body": body, "more_body": True})
        self.written += 1
        return True

    def on_gone(self, callback: Any) -> bool:
        return True  # (the client stays)


def offering_calls(app: FrontendApp, accept: list[bool], made: list[NowCalls]) -> Any:
    async def server(scope: dict[str, Any], receive: Any, send: Any) -> None:
        calls = NowCalls(send, accept)
        made.append(calls)

        async def asgi_send(message: dict[str, Any]) -> None:
            calls.started |= message["type"] == "http.response.start"
            await send(message)

        await app({**scope, "extensions": {EXTENSIONS: calls}}, receive, asgi_send)
    return server


async def run_request(pre: Preprocessor, h: Harness, body: dict[str, Any],
                      accept: list[bool] | None = None,
                      made: list[NowCalls] | None = None) -> httpx.Response:
    """One request through the app; `accept`: over a server offering the calls beside ASGI."""
    app: Any = FrontendApp(FrontendConfig(model="/m/tiny", served_model_name="tiny"), h, pre)
    if accept is not None:
        app = offering_calls(app, accept, made if made is not None else [])
    transport = httpx.ASGITransport(app=app)
    await h.start()
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/v1/completions", json=body)
        for _ in range(3):  # the last Aborts leave
            await asyncio.sleep(0)
        return r
    finally:
        await h.close()


@st.composite
def scenario(draw: st.DrawFn) -> dict[str, Any]:
    text = draw(st.text(alphabet=ALPHABET, min_size=1, max_size=60))
    n_cuts = draw(st.integers(0, 12))
    return {
        "text": text,
        "cuts": draw(st.lists(st.integers(0, 80), min_size=n_cuts, max_size=n_cuts)),
        "cumulative": draw(st.booleans()),
        "lookahead": draw(st.lists(st.booleans(), min_size=1, max_size=4)),
        "wire": draw(st.booleans()),
        "interval": draw(st.integers(1, 8)),
        "accept": draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=1, max_size=4))),
        "n": draw(st.sampled_from([1, 1, 2])),
        "stops": draw(st.lists(
            st.one_of(st.text(alphabet=ALPHABET, min_size=1, max_size=3),
                      st.integers(0, 60).flatmap(
                          lambda i: st.integers(1, 4).map(lambda k: text[i:i + k]))),
            max_size=2).map(lambda ss: [s for s in ss if s])),
    }


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenario())
def test_client_reassembles_exactly_what_the_engine_produced(pre: Preprocessor,
                                                             sc: dict[str, Any]) -> None:
    ids = pre.tokenizer.encode(sc["text"], add_special_tokens=False).ids
    full = pre.tokenizer.decode(ids)
    want, want_finish = expected_text(full, sc["stops"])
    h = Harness()
    h.make = lambda rid: worker_deltas(
        rid, engine_outputs(ids, sc["cuts"], sc["cumulative"], sc["lookahead"]),
        sc["cumulative"], sc["wire"])
    body = {"prompt": "x", "stream": True, "max_tokens": 100, "n": sc["n"],
            "stream_interval": sc["interval"], "stream_options": {"include_usage": True}}
    if sc["stops"]:
        body["stop"] = sc["stops"]
    made: list[NowCalls] = []
    r = asyncio.run(run_request(pre, h, body, sc["accept"], made))
    assert r.status_code == 200
    if sc["accept"] is not None and all(sc["accept"]) and len(h.make("r")) >= 3 \
            and sc["interval"] == 1 and sc["n"] == 1 and want_finish == "length":
        # Deltas after the first arrive while the task waits: the route production takes was
        # taken (each of them is a chunk: interval 1).
        assert made[0].written > 0
    evs = parse_sse(r.text)
    assert evs[-1] == "[DONE]"
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for e in evs[:-2]:
        assert "error" not in e, e
        for c in e["choices"]:
            assert c["index"] not in finishes, "a chunk after the finish"
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"] is not None:
                finishes[c["index"]] = c["finish_reason"]
    assert texts == {i: want for i in range(sc["n"])} or (not want and not texts)
    assert finishes == {i: want_finish for i in range(sc["n"])}
    received = sum(s.received for s in h.streams)
    # Usage: what the client was given, however the deltas merged on the way.
    given = tokens_given(pre, ids, full, sc["stops"]) * sc["n"]
    assert evs[-2]["usage"]["completion_tokens"] == given
    if want_finish == "length":
        assert received == len(ids) * sc["n"]
        assert h.link.num_in_flight == 0 and not any(isinstance(m, wire.Abort) for m in h.sent)
    assert h.link.protocol_errors == 0


@settings(max_examples=50, deadline=None)
@given(n_tokens=st.integers(2, 12), at=st.integers(1, 11), shift=st.sampled_from([-2, -1, 1, 3]),
       n=st.sampled_from([1, 3]))
def test_a_gap_or_overlap_fails_loudly_and_is_counted(pre: Preprocessor, n_tokens: int, at: int,
                                                      shift: int, n: int) -> None:
    at = min(at, n_tokens - 1)
    ids = pre.tokenizer.encode("abcdefghijklmnop", add_special_tokens=False).ids[:n_tokens]
    h = Harness()

    def make(rid: str) -> list[Delta]:
        ds = [Delta(rid, i, [t]) for i, t in enumerate(ids)]
        ds[-1].finish_reason = "length"
        ds[at].offset = max(0, ds[at].offset + shift) if ds[at].offset + shift != at else at + 1
        return ds
    h.make = make
    r = asyncio.run(run_request(pre, h, {"prompt": "x", "stream": True, "n": n,
                                         "max_tokens": 20}))
    if r.status_code != 200:  # several choices may all fail before the first byte went out
        assert n > 1 and r.status_code == 500 and r.json()["error"]["type"] == "protocol_error"
    else:
        evs = parse_sse(r.text)
        assert evs[-1] == "[DONE]" and evs[-2]["error"]["type"] == "protocol_error"
        assert not any(c["finish_reason"] for e in evs[:-2] for c in e["choices"])
    assert h.link.protocol_errors >= 1
    metric = [line for line in h.metrics().splitlines()
              if line.startswith("tandem_delta_protocol_errors_total{")]
    assert metric and float(metric[0].rsplit(" ", 1)[1]) == h.link.protocol_errors
    aborted = {rid for m in h.sent if isinstance(m, wire.Abort) for rid in m.rids}
    left = {g.rid for m in h.sent if isinstance(m, wire.Generates) for g in m.items}
    # Every choice left unfinished is aborted on the worker, unless its Generate never left (a
    # request placed and ended within one loop pass is never sent).
    assert aborted == {s.rid for s in h.streams} & left
    assert h.link.num_in_flight == 0
