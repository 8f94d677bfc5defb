"""The incremental detokenizer: emitted text equals the full decode cut at the first stop string,
whatever the chunking; no chunk carries a broken character or part of a stop string."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tandem.frontend.detokenizer import Detokenizer, DetokenizerFactory, byte_table
from tests.fakes import train_multilingual_tokenizer

TOK = train_multilingual_tokenizer()
VOCAB = TOK.get_vocab_size()
FACTORIES = {
    "byte_level": DetokenizerFactory(TOK),
    "window": DetokenizerFactory(TOK, byte_level=False),
}


def expected_text(full: str, stops: list[str]) -> str:
    """The full text cut before the stop occurrence that ends first (ties: the longer one)."""
    best: tuple[int, int] | None = None
    for s in stops:
        i = full.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best):
            best = (i + len(s), i)
    return full if best is None else full[:best[1]]


def run(det: Detokenizer, chunks: list[list[int]]) -> list[str]:
    out = []
    for i, chunk in enumerate(chunks):
        out.append(det.step(chunk, final=i == len(chunks) - 1))
        if det.stopped:
            break
    return out


def chunked(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])] or [[]]


token_ids = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), max_size=40),
    st.text(max_size=40).map(lambda s: TOK.encode(s, add_special_tokens=False).ids),
    st.sampled_from(["🙂🙃👍🏽 你好", "héllo wörld", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 stop"]).map(
        lambda s: TOK.encode(s, add_special_tokens=False).ids),
)


@pytest.mark.parametrize("mode", list(FACTORIES))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=token_ids, cuts=st.lists(st.integers(0, 60), max_size=12), data=st.data())
def test_emitted_text_is_full_decode_cut_at_first_stop(mode: str, ids: list[int], cuts: list[int],
                                                        data: Any) -> None:
    full = TOK.decode(ids, skip_special_tokens=True)
    stop_from_text = st.builds(lambda a, n: full[a:a + n], st.integers(0, max(len(full) - 1, 0)),
                               st.integers(1, 4))
    stops = data.draw(st.lists(st.one_of(stop_from_text, st.text(min_size=1, max_size=3)),
                               max_size=3).map(lambda xs: [x for x in xs if x]))
    det = FACTORIES[mode].new(stops)
    out = run(det, chunked(ids, cuts))
    want = expected_text(full, stops)
    assert "".join(out) == want
    assert det.stopped == any(s in full for s in stops)
    if "\ufffd" not in full:
        assert all("\ufffd" not in chunk for chunk in out)
    assert all(s not in want for s in stops)


def test_split_emoji_waits_for_its_last_byte() -> None:
    det = FACTORIES["byte_level"].new()
    table = byte_table(TOK)
    byte_tok = {t[0]: i for i, t in enumerate(table) if len(t) == 1}
    emoji_bytes = "🙂".encode()
    parts = [det.step([TOK.token_to_id("a")])]
    for b in emoji_bytes:
        parts.append(det.step([byte_tok[b]]))
    parts.append(det.step([TOK.token_to_id("b")], final=True))
    assert parts == ["a", "", "", "", "🙂", "b"]


@pytest.mark.parametrize("mode", list(FACTORIES))
def test_stop_string_across_tokens_is_cut_and_never_emitted(mode: str) -> None:
    ids = TOK.encode("Hello world! stop STOP", add_special_tokens=False).ids
    det = FACTORIES[mode].new(["d! st"])
    out = [det.step([i]) for i in ids]
    assert "".join(out) == "Hello worl"
    assert det.stopped
    assert det.step(ids, final=True) == ""


@pytest.mark.parametrize("mode", list(FACTORIES))
def test_held_back_tail_is_flushed_on_finish(mode: str) -> None:
    ids = TOK.encode("the end", add_special_tokens=False).ids
    det = FACTORIES[mode].new(["endless"])
    out = [det.step([i]) for i in ids]
    assert "".join(out) == "t"  # six characters held back: they could begin "endless"
    assert det.finish() == "he end"
    assert not det.stopped


def test_first_ending_stop_wins_not_list_order() -> None:
    det = FACTORIES["byte_level"].new(["abcd", "bc"])
    assert det.step(TOK.encode("xabcd", add_special_tokens=False).ids, final=True) == "xa"


def test_special_tokens_are_skipped() -> None:
    im_end = TOK.token_to_id("<|im_end|>")
    ids = TOK.encode("hi", add_special_tokens=False).ids + [im_end]
    for f in FACTORIES.values():
        assert f.new().step(ids, final=True) == "hi"


class _CountingTokenizer:
    """Records the longest id list the windowed decoder asks to decode."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.longest = 0
        self.decoder = tok.decoder

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)


def test_window_decoder_work_per_step_does_not_grow() -> None:
    counting = _CountingTokenizer(TOK)
    factory = DetokenizerFactory(counting, byte_level=False)  # type: ignore[arg-type]
    ids = TOK.encode("naïve café 🙂 " * 200, add_special_tokens=False).ids
    det = factory.new(["never"], context_ids=ids[:20])
    text = "".join(det.step([i]) for i in ids) + det.finish()
    assert text == TOK.decode(ids)
    assert counting.longest <= 16


def test_byte_level_is_detected() -> None:
    assert FACTORIES["byte_level"].byte_level
    assert not FACTORIES["window"].byte_level
    assert DetokenizerFactory(TOK).byte_level
