"""The small proxy vLLM's PD needs on this machine (its CPU wheel ships none): each OpenAI chat or
completion request goes to the prefill server first, unstreamed, with `max_tokens: 1` and
`kv_transfer_params: {"do_remote_decode": true}`; the `kv_transfer_params` it answers with go,
with the original request, to the decode server, whose answer (streamed or not) is passed back
as it comes. This is the recipe of vLLM's own example proxy, written here for the benchmark.

    python -m perf.peers.vllm_pd_proxy --port 18110 --prefill http://127.0.0.1:18101 \\
        --decode http://127.0.0.1:18102
"""

from __future__ import annotations

import argparse

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

TIMEOUT = ClientTimeout(total=600)


def make_app(prefill: str, decode: str) -> web.Application:
    state: dict[str, ClientSession] = {}

    async def start(app: web.Application) -> None:
        # A connection per request: vLLM's server closes idle keep-alive connections after 5 s,
        # and a pooled one it has just closed fails the request written into it.
        state["s"] = ClientSession(timeout=TIMEOUT, connector=TCPConnector(force_close=True))

    async def stop(app: web.Application) -> None:
        await state["s"].close()

    async def health(request: web.Request) -> web.Response:
        for url in (prefill, decode):
            async with state["s"].get(url + "/health") as r:
                if r.status != 200:
                    return web.Response(status=503, text=f"{url} not ready")
        return web.Response(text="ok")

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        first = {**body, "max_tokens": 1, "stream": False,
                 "kv_transfer_params": {"do_remote_decode": True}}
        first.pop("stream_options", None)
        first.pop("max_completion_tokens", None)
        async with state["s"].post(prefill + request.path, json=first) as r:
            answer = await r.json()
            if r.status != 200:
                return web.json_response(answer, status=r.status)
        body["kv_transfer_params"] = answer.get("kv_transfer_params")
        async with state["s"].post(decode + request.path, json=body) as r:
            out = web.StreamResponse(status=r.status, headers={
                "Content-Type": r.headers.get("Content-Type", "application/json")})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True, help="URL of vLLM's prefill server")
    p.add_argument("--decode", required=True, help="URL of vLLM's decode server")
    a = p.parse_args()
    web.run_app(make_app(a.prefill.rstrip("/"), a.decode.rstrip("/")), host=a.host, port=a.port,
                print=None, access_log=None)


if __name__ == "__main__":
    main()
