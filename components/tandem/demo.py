"""What `tandem up` shows once its cluster serves: a sample `curl`, and with `--demo` one chat
completion streamed to the terminal, with the model's raw output kept from driving it."""

from __future__ import annotations

import json
import shlex
import unicodedata
import urllib.request

DEMO_MAX_TOKENS = 96
DEMO_QUESTION = "Give me three tips for a good night's sleep."


def printable(text: str) -> str:
    """`text` with control and format characters (escape sequences, bells, bidi overrides) shown
    as U+FFFD: a model's raw output must not drive the terminal. Newlines and tabs stay."""
    return "".join(c if c in "\n\t" or unicodedata.category(c)[0] != "C" else "\ufffd"
                   for c in text)


def sample_curl(url: str, model: str) -> str:
    body = json.dumps({"model": model, "max_tokens": 32, "stream": True,
                       "messages": [{"role": "user", "content": "Hello!"}]})
    return (f"curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d {shlex.quote(body)}")


def stream_demo(url: str, model: str) -> None:
    body = json.dumps({
        "model": model, "stream": True, "max_tokens": DEMO_MAX_TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": DEMO_QUESTION}],
    }).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    print(f"\n--- streaming a chat completion (temperature 0, at most {DEMO_MAX_TOKENS} tokens) ---")
    print(f"user: {DEMO_QUESTION}\nassistant: ", end="", flush=True)
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                print(f"\n[error] {printable(str(chunk['error'].get('message')))}")
                continue
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content") or ""
                print(printable(text), end="", flush=True)
    print("\n--- done ---\n", flush=True)
