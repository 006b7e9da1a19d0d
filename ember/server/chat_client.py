"""`ember chat`: a small terminal client for a running server, for trying ember by hand.

Each line you type is a user message; the reply streams in as it is generated and joins
the history, so the conversation (and the server's prefix cache) grows turn by turn. After
each reply a `[usage]` line on stderr gives the prompt, cached and completion tokens.
`/reset` clears the history, `/exit` (or end of input) quits. Input that is not a
terminal is read line by line the same way, so the client can be scripted.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from ember import envs
from ember.headers import SESSION_HEADER

if TYPE_CHECKING:
    import httpx  # imported where used: `ember serve` parses its flags without it


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server address")
    parser.add_argument("--model", default=None, help="model name (default: the server's)")
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--api-key", default=None, help="API key (default: $EMBER_API_KEY)")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--session", default=None, help="x-session-affinity header to send")


def run_chat(args: argparse.Namespace) -> int:
    import httpx

    headers = {}
    key = args.api_key or envs.api_key()
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if args.session:
        headers[SESSION_HEADER] = args.session
    with httpx.Client(base_url=args.url, headers=headers, timeout=None) as client:
        try:
            model = args.model or _server_model(client)
        except (httpx.HTTPError, ChatError) as exc:
            print(f"ember chat: cannot reach {args.url}: {exc}", file=sys.stderr)
            return 1
        history = [{"role": "system", "content": args.system}] if args.system else []
        interactive = sys.stdin.isatty()
        print(f"chatting with {model} at {args.url} (/reset, /exit)", file=sys.stderr)
        while True:
            try:
                line = input("> " if interactive else "")
            except EOFError:
                return 0
            if line.strip() == "/exit":
                return 0
            if line.strip() == "/reset":
                history = history[:1] if args.system else []
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            try:
                reply = _stream_reply(client, model, history, args)
            except (httpx.HTTPError, ChatError) as exc:
                print(f"\nember chat: {exc}", file=sys.stderr)
                history.pop()
                continue
            history.append({"role": "assistant", "content": reply})


class ChatError(RuntimeError):
    pass


def _server_model(client: httpx.Client) -> str:
    response = client.get("/v1/models")
    _raise_for_error(response)
    return response.json()["data"][0]["id"]


def _stream_reply(client: httpx.Client, model: str, history: list[dict], args) -> str:
    body = {
        "model": model,
        "messages": history,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
    }
    parts, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            _raise_for_error(response)
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise ChatError(chunk["error"]["message"])
            for choice in chunk["choices"]:
                text = choice["delta"].get("content") or ""
                parts.append(text)
                print(text, end="", flush=True)
            if chunk.get("usage"):
                usage = chunk["usage"]
    print()
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    print(
        f"[usage] prompt={usage['prompt_tokens']} cached={cached} "
        f"completion={usage['completion_tokens']}",
        file=sys.stderr,
    )
    return "".join(parts)


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code == 200:
        return
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    raise ChatError(f"HTTP {response.status_code}: {message}")
