"""tandem-chat: a multi-turn chat in the terminal, on top of a served Tandem (serve.port=PORT).

    tandem-chat --url http://127.0.0.1:8000/v1 [--api-key KEY] [--system "..."] [--max-tokens 512] [--temperature 0.7]

The key (the server's serve.api_key_file) may come from the environment instead: OPENAI_API_KEY.

Each turn sends the whole conversation; the server finds it in its caches and prefills only the new
message. Type /reset to start over, /exit or Ctrl-D to leave. Standard library only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

RETRY_FOR_S = 120.0  # a 503 with Retry-After (the server's ranks restarting) is retried for up to this long


def stream_chat(url: str, body: dict, timeout_s: float = 600.0, api_key: str | None = None,
                retry_for_s: float = RETRY_FOR_S, note=None):
    """Yield the answer's text pieces from a streamed /chat/completions; the last item is the final chunk. A 503
    with Retry-After is tried again (open_retrying)."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(f"{url.rstrip('/')}/chat/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers=headers)
    with open_retrying(req, timeout_s, retry_for_s, note) as resp:
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", "server error"))
            choice = chunk["choices"][0]
            if choice.get("delta", {}).get("content"):
                yield choice["delta"]["content"]
            if choice.get("finish_reason"):
                yield chunk


def open_retrying(req: urllib.request.Request, timeout_s: float, retry_for_s: float = RETRY_FOR_S, note=None):
    """urlopen, again after a 503 that carries Retry-After (the front answers so while torchrun restarts the
    ranks, launch/serve/front.py), as long as the next try starts within `retry_for_s`; any other error at once."""
    note = note or (lambda line: print(line, file=sys.stderr, flush=True))
    deadline = time.monotonic() + retry_for_s
    while True:
        try:
            return urllib.request.urlopen(req, timeout=timeout_s)
        except urllib.error.HTTPError as e:
            delay = retry_after(e)
            if delay is None or time.monotonic() + delay > deadline:
                raise
            note(f"[{error_message(e)}; retrying in {delay:g} s]")
            time.sleep(delay)


def retry_after(e: "urllib.error.HTTPError") -> float | None:
    """A 503's Retry-After in seconds (capped at 30), None for any other answer."""
    value = e.headers.get("Retry-After", "") if e.code == 503 else ""
    return min(float(value), 30.0) if value.strip().isdigit() else None


def error_message(e: "urllib.error.HTTPError") -> str:
    try:
        return json.load(e)["error"]["message"]
    except (ValueError, KeyError, TypeError, OSError):
        return str(e.reason)


def turn(url: str, messages: list[dict], args, out=sys.stdout) -> tuple[str, dict | None]:
    """Send the conversation, print the answer as it streams; returns (answer, the final chunk)."""
    body = {"messages": messages}
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        body["temperature"] = args.temperature
    answer, final = "", None
    for piece in stream_chat(url, body, api_key=getattr(args, "api_key", None)):
        if isinstance(piece, dict):
            final = piece
            continue
        answer += piece
        out.write(piece)
        out.flush()
    out.write("\n")
    return answer, final


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's /v1 address")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="the server's key (serve.api_key_file); default: $OPENAI_API_KEY")
    ap.add_argument("--system", default=None, help="a system message for the whole conversation")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="default: as many as fit, up to the server's gen.max_new_tokens (more is refused)")
    ap.add_argument("--temperature", type=float, default=None, help="default: the server's gen.temperature")
    ap.add_argument("--stats", action="store_true", help="after each answer, print tokens/s and reused prompt tokens")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"tandem-chat: {args.url} (/reset starts over, /exit or Ctrl-D leaves)", file=sys.stderr)
    while True:
        try:
            text = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if text.strip() in ("/exit", "/quit"):
            return
        if text.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        try:
            answer, final = turn(args.url, messages, args)
        except KeyboardInterrupt:  # stop this answer (closing the stream cancels it on the server), keep chatting
            print("\n[interrupted]", file=sys.stderr)
            messages.pop()
            continue
        except urllib.error.HTTPError as e:  # the server answered: its error JSON says why
            print(f"tandem-chat: {e.code} {error_message(e)}", file=sys.stderr)
            messages.pop()
            continue
        except (urllib.error.URLError, RuntimeError, OSError) as e:
            print(f"tandem-chat: {getattr(e, 'reason', e)}; is the server running at {args.url}?", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": answer})
        if args.stats and final and "tandem" in final:
            t = final["tandem"]
            print(f"[{t['tokens_per_s']:.1f} tokens/s, {t['prompt_tokens_reused']} prompt tokens reused, "
                  f"{t['prefilled_tokens']} prefilled]", file=sys.stderr)


if __name__ == "__main__":
    main()
