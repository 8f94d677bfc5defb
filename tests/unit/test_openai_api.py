"""Request decoding and validation (400s with the offending param), the context-length rule, and
response bodies that the OpenAI SDK parses."""

from __future__ import annotations

import json

import msgspec
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tandem.frontend import openai_api as api
from tandem.frontend import schemas
from tandem.frontend import validate
from tandem.frontend import sse
from tandem.runtime import errors


def chat(**fields: object) -> schemas.ChatCompletionRequest:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    return validate.decode_request(json.dumps(body).encode(), schemas.ChatCompletionRequest)


def completion(**fields: object) -> schemas.CompletionRequest:
    body = {"model": "tiny", "prompt": "hi", **fields}
    return validate.decode_request(json.dumps(body).encode(), schemas.CompletionRequest)


def bad(fn, *args: object,  # type: ignore[no-untyped-def]
        **kwargs: object) -> errors.TandemError:
    with pytest.raises(errors.TandemError) as info:
        fn(*args, **kwargs)
    return info.value


@pytest.mark.parametrize("body, param", [
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}', "max_tokens"),
    (b'{"messages": [{"role": 3, "content": "hi"}]}', "messages[0].role"),
    (b'{"messages": "hi"}', "messages"),
    (b'{"model": "tiny"}', "messages"),
    (b'{"messages": [], "stream": "yes"}', "stream"),
])
def test_wrong_types_are_400_with_the_field_path(body: bytes, param: str) -> None:
    err = bad(validate.decode_request, body, schemas.ChatCompletionRequest)
    assert err.status == 400 and err.param == param


def test_malformed_json_is_400() -> None:
    err = bad(validate.decode_request, b'{"messages": [', schemas.ChatCompletionRequest)
    assert err.status == 400 and "Malformed JSON" in err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_unknown_fields_are_refused_by_name() -> None:
    """N8: a typo'd `max_token` was accepted and ran to the end of the context."""
    err = bad(chat, max_token=3)
    assert err.status == 400 and err.param == "max_token"
    assert "`max_token`: unknown field (did you mean `max_tokens`?)" in err.message


def test_every_refused_field_is_named_with_its_reason() -> None:
    err = bad(completion, prompt_cache_key="a", temperature=0, made_up=1, use_beam_search=True)
    assert err.param == "prompt_cache_key,made_up,use_beam_search"
    assert "`prompt_cache_key`: not supported" in err.message
    assert "`made_up`: unknown field;" in err.message
    assert "`use_beam_search`: beam search is not supported" in err.message
    assert err.message.startswith("Unrecognized request arguments supplied: ")


def test_a_flood_of_unknown_fields_gets_a_short_answer() -> None:
    err = bad(completion, **{f"k{i}" + "x" * 100: 1 for i in range(10_000)})
    assert err.param is not None and len(err.param.split(",")) == 32
    assert err.message.endswith("and 9968 more.") and len(err.message) < 4000


def test_nested_unknown_fields_name_their_path() -> None:
    err = bad(chat, stream=True, stream_options={"include_usage": True, "usage": True})
    assert err.param == "stream_options.usage"
    err = bad(chat, response_format={"type": "json_schema", "schema": {}})
    assert err.param == "response_format.schema"


def test_fields_tandem_applies_and_sdk_message_keys_pass() -> None:
    """vLLM's and SGLang's fields that tandem honours stay accepted; a chat message sent back as
    the SDK gave it (refusal, annotations, audio, function_call) is not refused."""
    req = chat(top_k=5, min_p=0.1, repetition_penalty=1.1, ignore_eos=True, min_tokens=1,
               skip_special_tokens=False, include_stop_str_in_output=True, stop_token_ids=[1],
               chat_template_kwargs={"x": 1}, stream_interval=2, regex="a+", user="u",
               messages=[{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "ok", "refusal": None,
                          "annotations": [], "audio": None, "function_call": None}])
    assert req.top_k == 5 and req.messages[1].content == "ok"


def test_unknown_model_is_404_in_openai_words() -> None:
    err = bad(validate.check_model, chat(model="gpt-9"), "tiny")
    assert err.status == 404 and err.code == "model_not_found" and err.param == "model"
    assert err.message == "The model `gpt-9` does not exist or you do not have access to it."
    validate.check_model(chat(model="tiny"), "tiny")
    validate.check_model(chat(model=None), "tiny")


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"n": 0}, "n"),
    ({"n": 65}, "n"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_interval": 0}, "stream_interval"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"stop_token_ids": [999999]}, "stop_token_ids"),
    ({"stop": ["x"] * 65}, "stop"),
    ({"stop": "x" * 1025}, "stop"),
])
def test_invalid_chat_requests_are_400(fields: dict[str, object], param: str) -> None:
    err = bad(validate.validate_chat, chat(**fields), 1000)
    assert err.status == 400 and err.param == param
    assert err.body()["error"]["param"] == param


def test_chat_messages_become_template_dicts() -> None:
    req = chat(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ])
    msgs = validate.validate_chat(req)
    assert msgs[1] == {"role": "user", "content": "a\nb"}
    assert msgs[2]["tool_calls"][0]["id"] == "1" and msgs[3]["tool_call_id"] == "1"


@pytest.mark.parametrize("prompt, want", [
    ("hello", ["hello"]), ([1, 2, 3], [[1, 2, 3]]), (["hello"], ["hello"]), ([[4, 5]], [[4, 5]]),
    (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompts_in_any_form(prompt: object, want: object) -> None:
    assert validate.validate_completion(completion(prompt=prompt)) == want


@pytest.mark.parametrize("fields, param", [
    ({"prompt": ["a"] * 65}, "prompt"),
    ({"prompt": [[1], []]}, "prompt[1]"),
    ({"prompt": [[1], [-2]]}, "prompt[1]"),
    ({"prompt": ["a"] * 5, "n": 64}, "n"),
    ({"n": 65}, "n"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"echo": True, "logprobs": 1}, "echo"),
    ({"logprobs": 21}, "logprobs"),
    ({"best_of": 2}, "best_of"),
    ({"suffix": "x"}, "suffix"),
])
def test_invalid_completion_requests_are_400(fields: dict[str, object], param: str) -> None:
    err = bad(validate.validate_completion, completion(**fields))
    assert err.status == 400 and err.param == param


def test_context_length_follows_vllm() -> None:
    req = completion(max_tokens=10)
    sp = validate.sampling_params(req, 10, 90, 100, 16)
    assert sp.max_tokens == 10
    err = bad(validate.sampling_params, req, 11, 90, 100, 16)
    assert err.status == 400 and err.param == "max_tokens" and "maximum context length is 100" \
        in err.message
    err = bad(validate.sampling_params, req, None, 100, 100, 16)
    assert err.param == "prompt" and "100 input tokens" in err.message
    # no max_tokens: the completions default, or for chat the rest of the context
    assert validate.sampling_params(completion(), None, 90, 100, 16).max_tokens == 10
    assert validate.sampling_params(completion(), None, 10, 100, 16).max_tokens == 16
    assert validate.sampling_params(chat(), None, 10, 100, None).max_tokens == 90


def test_sampling_params_map_the_request() -> None:
    req = chat(temperature=0, top_p=0.5, top_k=-1, seed=7, stop_token_ids=[3], ignore_eos=True,
               min_tokens=2, max_completion_tokens=8, max_tokens=100)
    validate.validate_chat(req)
    sp = validate.sampling_params(req, validate.chat_max_tokens(req), 5, 100, None)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (8, 0, 0.5, 0, 7)
    assert (sp.stop_token_ids, sp.ignore_eos, sp.min_tokens) == ((3,), True, 2)
    assert validate.stops_of(chat(stop="x")) == ("x",)


def _sse_json(event: bytes) -> dict:  # type: ignore[type-arg]
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    return json.loads(event[6:-2])


@pytest.mark.parametrize("finish", [None, "stop", "length"])
def test_fast_chunks_equal_the_struct_encoding(finish: str | None) -> None:
    text = 'he said "¡hola!" \n\t🙂 \u2028'
    enc = sse.ChunkEncoder("chat", "chatcmpl-x\"y", 1700000000, "mo\"del")
    got = _sse_json(enc.text(text, finish))
    want = msgspec.json.decode(msgspec.json.encode(schemas.ChatCompletionChunk(
        "chatcmpl-x\"y", "chat.completion.chunk", 1700000000, "mo\"del",
        [schemas.ChatChunkChoice(0, schemas.ChatDelta(content=text), None, finish)])))
    assert got == want
    chunk = ChatCompletionChunk.model_validate(got)
    assert chunk.choices[0].delta.content == text and chunk.choices[0].finish_reason == finish

    enc = sse.ChunkEncoder("completion", "cmpl-1", 5, "m")
    got = _sse_json(enc.text(text, finish))
    assert got == msgspec.json.decode(msgspec.json.encode(
        schemas.Completion("cmpl-1", "text_completion", 5, "m",
                       [schemas.CompletionChoice(0, text, None, finish)])))
    if finish is not None:  # the SDK types a completion's finish_reason as required; its
        # stream parser is lenient, as OpenAI's own stream chunks carry null there too
        assert Completion.model_validate(got).choices[0].text == text


def test_other_chunks_parse_with_the_sdk() -> None:
    enc = sse.ChunkEncoder("chat", "chatcmpl-1", 5, "m")
    role = ChatCompletionChunk.model_validate(_sse_json(enc.role()))
    assert role.choices[0].delta.role == "assistant"
    fin = ChatCompletionChunk.model_validate(_sse_json(enc.finish("stop")))
    assert fin.choices[0].delta.content is None and fin.choices[0].finish_reason == "stop"
    usage = ChatCompletionChunk.model_validate(_sse_json(enc.usage(api.usage_info(3, 4))))
    assert usage.choices == [] and usage.usage is not None and usage.usage.total_tokens == 7
    comp = sse.ChunkEncoder("completion", "cmpl-1", 5, "m")
    assert Completion.model_validate(_sse_json(comp.usage(api.usage_info(1, 2)))).usage.total_tokens == 3  # type: ignore[union-attr]


def test_full_responses_parse_with_the_sdk() -> None:
    body = msgspec.json.encode(api.chat_completion("chatcmpl-1", 5, "m", "hi", "length",
                                                   api.usage_info(3, 2)))
    cc = ChatCompletion.model_validate_json(body)
    assert cc.choices[0].message.content == "hi" and cc.usage is not None
    assert (cc.usage.prompt_tokens, cc.usage.completion_tokens, cc.usage.total_tokens) == (3, 2, 5)
    body = msgspec.json.encode(api.text_completion("cmpl-1", 5, "m", "hi", "stop",
                                                   api.usage_info(1, 1)))
    c = Completion.model_validate_json(body)
    assert c.object == "text_completion" and c.choices[0].finish_reason == "stop"


def test_a_chat_request_has_at_most_max_messages() -> None:
    from tandem.frontend.schemas import MAX_MESSAGES, ChatCompletionRequest, TokenizeRequest
    from tandem.frontend.validate import decode_request
    from tandem.runtime import errors

    def body(n: int) -> bytes:
        return json.dumps({"messages": [{"role": "user", "content": "x"}] * n}).encode()

    assert len(decode_request(body(MAX_MESSAGES), ChatCompletionRequest).messages) == MAX_MESSAGES
    for cls in (ChatCompletionRequest, TokenizeRequest):
        with pytest.raises(errors.BadRequest) as e:
            decode_request(body(MAX_MESSAGES + 1), cls)
        assert e.value.param == "messages"
