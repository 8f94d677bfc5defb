"""Keyless is opt-in everywhere (N9/N2): a worker or frontend started by hand finds the cluster's
keys (--auth-keys, or where `tandem keys init` writes by default) or refuses to start saying how,
unless --no-auth says by name that it runs keyless; /workers, which says where the KV events
(every cached prompt's token ids) are published, answers loopback clients and holders of the
admin token only. (KV from an unauthenticated peer is never cached: tests/unit/test_engine_pd.py.)
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tandem.cli import main
from tandem.config import FrontendConfig
from tandem.frontend.app import FrontendApp
from tandem.frontend.preprocess import Preprocessor
from tandem.runtime.auth import AuthError, default_keys_dir, resolve_keys_dir
from tests.fakes import FakePool


@pytest.fixture
def mock_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(
        '{"vocab_size": 100, "max_position_embeddings": 64, "eos_token_id": 2}')
    return str(tmp_path)


@pytest.fixture
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    return home


@pytest.mark.parametrize("role", [["worker", "--engine", "mock"], ["frontend", "--workers",
                                                                    "tcp://127.0.0.1:9"]])
def test_a_process_without_keys_refuses_to_start_and_says_how(
        role: list[str], mock_dir: str, config_home: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main([role[0], "--model", mock_dir, *role[1:]]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tandem {role[0]}: no cluster keys")
    for how in ("--auth-keys DIR", "`tandem keys init`", "--no-auth",
                str(config_home / "tandem" / "keys")):
        assert how in err


def test_keys_init_writes_the_default_directory_that_processes_find(
        config_home: Path) -> None:
    with pytest.raises(AuthError):
        resolve_keys_dir("", False)
    assert main(["keys", "init"]) == 0
    d = default_keys_dir()
    assert d == config_home / "tandem" / "keys" and (d / "cluster.key_secret").is_file()
    assert resolve_keys_dir("", False) == str(d)
    assert resolve_keys_dir("", True) == ""  # --no-auth, by name: keyless
    assert resolve_keys_dir("/given", False) == "/given"
    with pytest.raises(AuthError, match="choose one"):
        resolve_keys_dir("/given", True)


@pytest.fixture(scope="module")
def pre(tiny_model: str) -> Preprocessor:
    return Preprocessor(tiny_model, "tiny")


async def _workers(pre: Preprocessor, client: tuple[str, int], token_file: str = "",
                   headers: dict[str, str] | None = None) -> httpx.Response:
    app = FrontendApp(FrontendConfig(model="/models/tiny", served_model_name="tiny",
                                     admin_token_file=token_file), FakePool(), pre)
    transport = httpx.ASGITransport(app=app, client=client)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        return await c.get("/workers", headers=headers or {})


async def test_workers_answers_loopback_and_the_admin_token_only(pre: Preprocessor,
                                                                 tmp_path: Path) -> None:
    """N9: `GET /workers` told any HTTP client where each worker's KV events are published."""
    assert (await _workers(pre, ("127.0.0.1", 5000))).status_code == 200
    r = await _workers(pre, ("10.1.2.3", 5000))
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert "--admin-token-file" in r.json()["error"]["message"]
    token = tmp_path / "admin-token"
    token.write_text("s3cret\n")
    outside = ("10.1.2.3", 5000)
    assert (await _workers(pre, outside, str(token))).status_code == 403
    assert (await _workers(pre, outside, str(token),
                           {"Authorization": "Bearer wrong"})).status_code == 403
    assert (await _workers(pre, outside, str(token),
                           {"Authorization": "Bearer s3cret"})).status_code == 200
    # The probes and the scrape stay open.
    app = FrontendApp(FrontendConfig(model="/models/tiny", served_model_name="tiny"),
                      FakePool(), pre)
    transport = httpx.ASGITransport(app=app, client=outside)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        assert (await c.get("/metrics")).status_code == 200
        assert (await c.get("/live")).status_code == 200
