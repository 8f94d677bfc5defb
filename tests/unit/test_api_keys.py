"""`--api-key-file` (tandem.frontend.apikeys): with it, every endpoint but the probes, the scrape and
the admin endpoint needs one of the file's keys (401 `invalid_api_key` otherwise, before anything
is read or opened), and the key a request presents is read by one rule for the gate, its tenant
and its cache partition."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.cli import parse
from tandem.config import FrontendConfig
from tandem.frontend.apikeys import presented, read_keys
from tandem.frontend.app import FrontendApp
from tandem.frontend.preprocess import Preprocessor
from tandem.frontend.salt import Salter
from tandem.frontend.tenants import tenant_of
from tests.fakes import FakePool, write_model_dir

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def pre(tmp_path_factory: pytest.TempPathFactory) -> Preprocessor:
    return Preprocessor(write_model_dir(tmp_path_factory.mktemp("keys") / "tiny"), "tiny")


@pytest.fixture
def key_file(tmp_path: Path) -> str:
    path = tmp_path / "api-keys"
    path.write_text("# the team's keys\nsk-alpha\n\n  sk-beta  \n")
    return str(path)


def _app(pre: Preprocessor, pool: FakePool, key_file: str) -> FrontendApp:
    return FrontendApp(FrontendConfig(model="/models/tiny", served_model_name="tiny",
                                      api_key_file=key_file), pool, pre)


async def _call(app: FrontendApp, method: str, path: str, headers: dict[str, str] | None = None,
                body: Any = None, client: tuple[str, int] = ("10.1.2.3", 5000)) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, client=client)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        return await c.request(method, path, headers=headers or {}, json=body)


async def test_without_a_key_the_api_answers_401_and_opens_nothing(pre: Preprocessor,
                                                                    key_file: str) -> None:
    pool = FakePool()
    app = _app(pre, pool, key_file)
    for headers, why in [({}, "didn't provide an API key"),
                         ({"Authorization": "Bearer sk-gamma"}, "Incorrect API key"),
                         ({"Authorization": "Basic sk-alpha"}, "didn't provide an API key"),
                         ({"api-key": "sk-alph"}, "Incorrect API key")]:
        for method, path, body in [("POST", "/v1/chat/completions", CHAT),
                                   ("POST", "/v1/completions", {"model": "tiny", "prompt": "x"}),
                                   ("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None),
                                   ("POST", "/tokenize", {"model": "tiny", "prompt": "x"}),
                                   ("GET", "/no/such/route", None)]:
            r = await _call(app, method, path, headers, body)
            assert r.status_code == 401, (path, headers, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
            assert why in err["message"]
    assert pool.opened == []


async def test_a_key_from_the_file_is_served_either_way_it_is_presented(
        pre: Preprocessor, key_file: str) -> None:
    pool = FakePool()
    app = _app(pre, pool, key_file)
    for headers, user in [({"Authorization": "Bearer sk-alpha"}, "u1"),
                          ({"Authorization": "Bearer sk-alpha"}, "u2"),
                          ({"api-key": "sk-beta"}, "u1")]:
        r = await _call(app, "POST", "/v1/chat/completions", headers, {**CHAT, "user": user})
        assert r.status_code == 200, r.text
    assert len(pool.opened) == 3
    assert (await _call(app, "GET", "/v1/models", {"authorization": "bearer sk-beta"})) \
        .status_code == 200
    # Two keys, two tenants: the tenant is the key, whatever `user` a request names.
    tenants = [t for t, _ in pool.tenants]
    assert tenants[0] == tenants[1] != tenants[2]


async def test_probes_scrape_and_admin_endpoint_keep_their_own_rules(pre: Preprocessor,
                                                                     key_file: str) -> None:
    app = _app(pre, FakePool(), key_file)
    for path in ("/health", "/live", "/metrics"):
        assert (await _call(app, "GET", path)).status_code == 200, path
    assert (await _call(app, "GET", "/workers", client=("127.0.0.1", 5000))).status_code == 200
    r = await _call(app, "GET", "/workers", {"Authorization": "Bearer sk-alpha"})
    assert r.status_code == 403  # an API key is not the admin token


async def test_a_server_without_a_key_file_stays_open(pre: Preprocessor) -> None:
    pool = FakePool()
    r = await _call(_app(pre, pool, ""), "POST", "/v1/chat/completions", None, CHAT)
    assert r.status_code == 200 and len(pool.opened) == 1


def test_the_key_file_is_read_strictly(tmp_path: Path) -> None:
    assert read_keys("") == frozenset()
    empty = tmp_path / "empty"
    empty.write_text("# no key yet\n\n")
    with pytest.raises(ValueError, match="holds no API key"):
        read_keys(str(empty))
    spaced = tmp_path / "spaced"
    spaced.write_text("sk-one two\n")
    with pytest.raises(ValueError, match="line 1: an API key is printable ASCII"):
        read_keys(str(spaced))
    assert len(read_keys(str(_write(tmp_path / "two", "a\nb\na\n")))) == 2


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("name, text, message", [
    ("missing", None, "cannot read"), ("empty", "\n", "holds no API key")])
def test_the_frontend_refuses_a_bad_key_file_at_start(
        tmp_path: Path, tiny_model: str, name: str, text: str | None, message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as e:
        parse(["frontend", "--model", tiny_model, "--workers", "tcp://127.0.0.1:9",
               "--no-auth", "--api-key-file", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--api-key-file" in err and message in err


def test_gate_tenant_and_cache_partition_read_the_same_key() -> None:
    for headers in ([(b"authorization", b"Bearer  sk-alpha ")], [(b"api-key", b"sk-alpha")],
                    [(b"x-other", b"1"), (b"api-key", b"sk-alpha"),
                     (b"authorization", b"Bearer sk-beta")]):
        assert presented(headers) == b"sk-alpha"
        scope: Any = {"headers": headers}
        assert tenant_of(scope, "someone", ("key", "user")) == \
            tenant_of({"headers": [(b"authorization", b"Bearer sk-alpha")]}, "", ("key",))
        assert Salter("api-key")(headers, "", None) == \
            Salter("api-key")([(b"authorization", b"Bearer sk-alpha")], "", None)
    assert presented([(b"authorization", b"Basic abc")]) == b""


def test_a_client_holding_the_key_file_presents_its_first_key(tmp_path: Path) -> None:
    """perf.streaming.sweep (the Kubernetes sweep Job's client) reads OPENAI_API_KEY as the
    frontend reads its file, and the gate takes the key it presents."""
    from perf.streaming.sweep import api_key_header
    from tandem.frontend.apikeys import ApiKeys

    text = "# the operator's keys\n\n  sk-first  \nsk-second\n"
    line = api_key_header(text)
    assert line == b"Authorization: Bearer sk-first\r\n"
    name, value = line.rstrip(b"\r\n").split(b": ", 1)
    gate = ApiKeys(read_keys(str(_write(tmp_path / "keys", text))))
    scope: Any = {"headers": [(name.lower(), value)]}
    assert gate.refusal("/v1/completions", scope) is None
    assert gate.refusal("/v1/completions", {"headers": [(b"authorization", b"Bearer sk-x")]})
    assert api_key_header("") == b"" and api_key_header(" \n") == b""
    with pytest.raises(ValueError, match="OPENAI_API_KEY, line 1"):
        api_key_header("sk one\n")
