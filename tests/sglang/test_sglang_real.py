"""The adapter against the REAL sglang package (installed without its CUDA deps: see
tests/sglang/requirements.txt): every ServerArgs field it sets exists and every value passes
SGLang's own argparse; every sampling dict it builds is accepted by SGLang's SamplingParams; its
call's keywords and the TokenizerManager names it relies on exist. A rename in SGLang fails here.

`sglang.srt.entrypoints.engine` and `tokenizer_manager` do not import on a CPU torch (they need a
torchvision built for CUDA torch), so those two are checked by parsing their installed source."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from tandem.engines.base import EngineRequest
from tandem.engines.sglang import (
    OWNED, SGLangOptions, SGLangSetupError, build_server_args, server_argv,
)
from tandem.engines.sglang_stream import ENGINE_ENV, generate_kwargs, sampling_dict
from tandem.runtime.wire import Bootstrap, SamplingParams

server_args_mod = pytest.importorskip(
    "sglang.srt.server_args",
    reason="the real sglang package is not installed: pip install --no-deps -r "
           "tests/sglang/requirements.txt")
sampling_mod = pytest.importorskip("sglang.srt.sampling.sampling_params")
ServerArgs = server_args_mod.ServerArgs
TESTED_VERSION = "0.5.23"


def handler(signum: int, frame: object) -> None:
    """A stand-in for the adapter's SIGQUIT handler."""


def fields() -> set[str]:
    import msgspec

    return {f.name for f in msgspec.structs.fields(ServerArgs)}


def test_the_installed_sglang_is_the_tested_release() -> None:
    from importlib.metadata import version

    assert version("sglang") == TESTED_VERSION


def test_every_field_the_adapter_sets_exists() -> None:
    names = fields()
    for dest in [*OWNED, "custom_sigquit_handler", "host", "log_level", "disable_overlap_schedule",
                 "base_gpu_id",
                 "disaggregation_transfer_backend", "enable_deterministic_inference"]:
        assert dest in names, f"ServerArgs has no field {dest!r}"
    assert "stream_output" not in names  # renamed incremental_streaming_output in 0.5.10


@pytest.mark.parametrize("role", ["agg", "prefill", "decode"])
@pytest.mark.parametrize("mode", ["cumulative", "incremental"])
def test_server_args_through_sglangs_own_argparse(role: str, mode: str) -> None:
    opts = SGLangOptions(model="/models/tiny", role=role, output_mode=mode,  # type: ignore[arg-type]
                         page_size=32, max_batch=8, num_pages=100, host="10.1.2.3",
                         bootstrap_port=9001 if role == "prefill" else 0, log_level="WARNING",
                         engine_args=("--tp-size", "1", "--mem-fraction-static", "0.7"))
    sa = build_server_args(opts, handler)
    assert isinstance(sa, ServerArgs)
    assert sa.model_path == "/models/tiny" and sa.page_size == 32 and sa.skip_tokenizer_init
    assert sa.disaggregation_mode == {"agg": "null"}.get(role, role)
    assert sa.incremental_streaming_output is (mode == "incremental")
    assert sa.disaggregation_transfer_backend == ("mooncake" if role == "agg" else "nixl")
    assert (sa.max_running_requests, sa.max_total_tokens) == (8, 3200)
    assert sa.host == "10.1.2.3" and sa.log_level == "warning"
    assert sa.custom_sigquit_handler is handler
    assert sa.tp_size == 1 and sa.mem_fraction_static == 0.7  # SGLang's own flags pass through
    if role == "prefill":
        assert sa.disaggregation_bootstrap_port == 9001


@pytest.mark.parametrize(("device", "cuda_id"), [("cpu", None), ("cuda", 0), ("cuda:2", 2)])
def test_the_device_through_sglangs_own_argparse(device: str, cuda_id: int | None) -> None:
    from tandem.engines.sglang_cpu import DEFAULT_MAX_TOTAL_TOKENS

    sa = build_server_args(SGLangOptions(model="/m", device=device))
    assert sa.device == device.partition(":")[0]
    assert sa.disable_overlap_schedule is (device == "cpu")
    assert sa.max_total_tokens == (DEFAULT_MAX_TOTAL_TOKENS if device == "cpu" else None)
    if cuda_id is not None:
        assert sa.base_gpu_id == cuda_id
    with pytest.raises(SGLangSetupError, match="--device"):
        build_server_args(SGLangOptions(model="/m", device=device, engine_args=("--device", "xpu")))


def test_sglang_flags_override_the_soft_defaults() -> None:
    sa = build_server_args(SGLangOptions(model="/m", role="decode", engine_args=(
        "--disaggregation-transfer-backend", "mooncake", "--log-level", "debug")))
    assert sa.disaggregation_transfer_backend == "mooncake" and sa.log_level == "debug"


@pytest.mark.parametrize(("args", "named"), [
    (("--no-such-flag",), "--no-such-flag"),
    (("--disaggregation-transfer-backend", "carrier-pigeon"), "carrier-pigeon"),
    (("--tp-size", "two"), "--tp-size"),
    (("--page-size", "64"), "--page-size"),
    (("--model", "/other"), "--model-path"),
    (("--incremental-streaming-output",), "--output-mode"),
])
def test_a_bad_or_conflicting_flag_is_an_error_naming_it(args: tuple[str, ...],
                                                         named: str) -> None:
    with pytest.raises(SGLangSetupError, match=named.replace("-", r"\-")):
        build_server_args(SGLangOptions(model="/m", engine_args=args))


def test_every_flag_tandem_passes_is_one_of_sglangs() -> None:
    from tandem.engines.sglang import sglang_parser

    parser = sglang_parser()
    known = {s for a in parser._actions for s in a.option_strings}
    for device in ("cpu", "cuda:1"):
        argv = server_argv(SGLangOptions(model="/m", role="prefill", output_mode="incremental",
                                         max_batch=1, num_pages=1, bootstrap_port=1, device=device))
        assert {a for a in argv if a.startswith("--")} <= known
    assert {flag for flag, _ in OWNED.values()} <= known


SAMPLINGS = [SamplingParams(), SamplingParams(max_tokens=5, temperature=0.0),
             SamplingParams(temperature=0.7, top_p=0.9, top_k=40, stop_token_ids=(2, 7),
                            ignore_eos=True),
             SamplingParams(top_k=0, seed=123),
             SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=2.0,
                            min_p=0.05, logit_bias={0: -100.0, 999: 100.0}),
             SamplingParams(temperature=0.0, json_schema='{"type": "object"}'),
             SamplingParams(regex="(yes|no)", repetition_penalty=0.5)]


@pytest.mark.parametrize("sp", SAMPLINGS)
def test_every_sampling_dict_is_accepted_by_sglang(sp: SamplingParams) -> None:
    d = sampling_dict(sp, deterministic=True)
    params = sampling_mod.SamplingParams(**d)  # an unknown or renamed key raises TypeError
    params.verify(1000)
    params.normalize(None)  # None: tandem starts SGLang with --skip-tokenizer-init
    assert params.max_new_tokens == sp.max_tokens
    assert params.top_k == (sp.top_k or sampling_mod.TOP_K_ALL) or sp.temperature == 0.0
    assert params.sampling_seed == sp.seed
    # The penalties, min_p, logit_bias and the grammars reach SGLang as tandem set them.
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            params.min_p) == (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty,
                              sp.min_p)
    assert params.logit_bias == (None if sp.logit_bias is None else
                                 {str(k): v for k, v in sp.logit_bias.items()})
    assert (params.json_schema, params.regex) == (sp.json_schema, sp.regex)


REQUESTS = [  # what an OpenAI request's constraint becomes, from the frontend to SGLang
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}},
    {"regex": "(yes|no) [0-9]+"},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
               {"type": "function", "function": {"name": "g"}}], "tool_choice": "required"},
]


@pytest.mark.parametrize("fields", REQUESTS)
def test_response_format_regex_and_tools_reach_sglangs_own_parameters(fields: dict) -> None:
    """`--engine sglang`: a request's response_format, regex or tool call becomes SGLang's own
    `json_schema` or `regex` sampling parameter, which SGLang's SamplingParams takes as is."""
    import json

    import msgspec

    from tandem.frontend import schemas, validate

    req = msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **fields},
                          schemas.ChatCompletionRequest)
    opts = validate.options(req)
    sp = validate.sampling_params(req, 16, 4, 1024, None, opts.constraint)
    params = sampling_mod.SamplingParams(**sampling_dict(sp, deterministic=False))
    params.verify(1000)
    params.normalize(None)
    assert (params.json_schema, params.regex) == (sp.json_schema, sp.regex)
    assert (params.json_schema or params.regex) is not None
    if params.json_schema is not None:
        assert isinstance(json.loads(params.json_schema), dict)


def test_sglang_refuses_what_tandem_checks_before_it() -> None:
    """tandem's own checks (check_sampling) refuse what SGLang's verify would: the same ranges."""
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3.0}, {"min_p": 1.5},
                {"logit_bias": {"1000": 1.0}}, {"repetition_penalty": 2.5}):
        with pytest.raises(ValueError):
            sampling_mod.SamplingParams(**bad).verify(1000)


def test_the_adapter_refuses_what_it_cannot_map_naming_the_field() -> None:
    from tandem.runtime.errors import EngineRequestError

    for sp, field in ((SamplingParams(repetition_penalty=2.5), "repetition_penalty"),
                      (SamplingParams(seed=1), "seed")):
        with pytest.raises(EngineRequestError) as e:
            sampling_dict(sp, deterministic=False)
        assert e.value.param == field
    # A moved request: what counts output tokens cannot continue exactly on SGLang.
    for sp in (SamplingParams(presence_penalty=0.5), SamplingParams(repetition_penalty=1.1),
               SamplingParams(json_schema='{"type": "object"}')):
        with pytest.raises(EngineRequestError) as e:
            generate_kwargs(EngineRequest("a", [1, 2, 3], sp, resume_offset=1), "0" * 32,
                            deterministic=False)
        assert e.value.param == "resume_offset"
        generate_kwargs(EngineRequest("a", [1, 2, 3], sp), "0" * 32, deterministic=False)
    plain = EngineRequest("a", [1, 2, 3], SamplingParams(temperature=0.7), resume_offset=2)
    assert generate_kwargs(plain, "0" * 32, deterministic=False)["input_ids"] == [1, 2, 3]


def test_logprobs_are_the_models_own_distribution_in_sglang_too() -> None:
    """tandem's contract: log_softmax of the raw logits. SGLang's sampler gives that only with
    SGLANG_RETURN_ORIGINAL_LOGPROB (read at import), which the adapter sets; its default divides
    by the temperature first."""
    source = ast.unparse(_source("sglang.srt.layers.sampler"))
    assert 'get_bool_env_var("SGLANG_RETURN_ORIGINAL_LOGPROB")' in source.replace("'", '"')
    assert ENGINE_ENV == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}


def test_what_the_adapter_refuses_sglang_cannot_honour() -> None:
    with pytest.raises(ValueError, match="skip_tokenizer_init"):  # min_tokens without tokenizer
        sampling_mod.SamplingParams(min_new_tokens=1).normalize(None)
    with pytest.raises(ValueError, match="top_k"):  # tandem's 0 must not reach SGLang as 0
        sampling_mod.SamplingParams(top_k=0).verify(1000)


def _source(module: str) -> ast.Module:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return ast.parse(Path(spec.origin).read_text(encoding="utf-8"))


def _method(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                    return item
    raise AssertionError(f"sglang has no {cls}.{name}")


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    a = fn.args
    return {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}


def test_call_keywords_match_engine_async_generate() -> None:
    fn = _method(_source("sglang.srt.entrypoints.engine"), "Engine", "async_generate")
    assert isinstance(fn, ast.AsyncFunctionDef)
    req = EngineRequest("a", [1, 2], SamplingParams(logprobs=3), Bootstrap("h", 1, 2))
    kwargs = generate_kwargs(req, "0" * 32, deterministic=False)
    assert {"return_logprob", "top_logprobs_num", "logprob_start_len"} <= set(kwargs)
    assert set(kwargs) <= _params(fn)


def test_tokenizer_manager_names_the_adapter_relies_on() -> None:
    tree = _source("sglang.srt.managers.tokenizer_manager")
    assert {"rid"} <= _params(_method(tree, "TokenizerManager", "abort_request"))
    _method(tree, "TokenizerManager", "auto_create_handle_loop")
    _method(tree, "SignalHandler", "sigterm_handler")
    _method(tree, "SignalHandler", "running_phase_sigquit_handler")
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
               and n.name == "TokenizerManager")
    body = ast.unparse(cls)
    for attr in ("signal_handler_class", "asyncio_tasks", "context_len", "model_config",
                 "_subprocess_watchdog", "rid_to_state"):
        assert f"self.{attr} =" in body or f"self.{attr}:" in body, attr
    loop = ast.unparse(_method(tree, "TokenizerManager", "auto_create_handle_loop"))
    assert "self.signal_handler_class(self)" in loop
    _method(_source("sglang.srt.entrypoints.engine"), "Engine", "shutdown")
