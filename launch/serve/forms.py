"""The answer forms: what one request's events (its text as rounds commit, its logprobs, its end or its error)
become on the wire, for each endpoint, side by side. Each form answers a whole request (`answer`) or streams it:
`start`, then per event `text` / `logprobs` / `done` / `error`, then `end` (launch/serve/app.py drives them).

    CompletionForm   /v1/completions        a text_completion, or text_completion chunks then [DONE]
    ChatForm         /v1/chat/completions   a chat.completion, or chat.completion.chunk deltas then [DONE]
    ResponsesForm    /v1/responses          a Response, or its typed events (no [DONE])

The Responses API's stream: response.created, response.in_progress, then per item response.output_item.added,
for a message response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, for a call response.function_call_arguments.delta and .done, then
response.output_item.done; last response.completed (or response.incomplete when max_output_tokens cut it; an error
event and response.failed when the server could not finish).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING

from launch.serve.errors import ApiError
from launch.serve.fields import Prompt
from launch.serve.structured import chat_logprobs, completion_logprobs
from launch.serve.tools import finish_reason

if TYPE_CHECKING:
    from launch.serve.engine import Job


def usage(prompt: Prompt, done: dict) -> dict:
    n_prompt, n_out = len(prompt.ids), len(done["token_ids"])
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def tandem_fields(done: dict) -> dict:
    """Beyond OpenAI's fields: what Tandem measured for this request."""
    s = done["stats"]
    return {"token_ids": done["token_ids"], "prompt_tokens_reused": s["prompt_tokens_reused"],
            "prefilled_tokens": s["prefilled_tokens"], "ttft_ms": s["ttft_s"] * 1000, "queue_ms": s["queue_s"] * 1000,
            "tokens_per_s": s["tokens_per_s"], "tokens_per_round": s["tokens_per_round"],
            "acceptance_rate": s["acceptance_rate"],
            # the cost model's figures for this request (speculative.cost_model; 0: none), beside the measured ones
            "predicted_tokens_per_s": s.get("predicted_tokens_per_s", 0.0),
            "predicted_tokens_per_s_timed": s.get("predicted_tokens_per_s_timed", 0.0),
            "predicted_ttft_ms": s.get("predicted_ttft_s", 0.0) * 1000}


def sse(body: dict, event: str | None = None) -> str:
    return (f"event: {event}\n" if event else "") + f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class CompletionForm:
    """/v1/completions: a text_completion, or text_completion chunks then [DONE]."""
    OPEN = {"text": ""}  # a streamed choice's empty form

    def __init__(self, job: Job, model: str):
        self.job, self.model, self.id, self.created = job, model, f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        self.offset = 0  # streamed logprobs: where the next token's text starts in the answer
        self.scored: list[tuple] = []  # streamed logprobs that go out with the next text: (tokens, rows) per event

    def body(self, choice: dict, **extra) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "logprobs": None, **choice}], **extra}

    def chunk(self, choice: dict, **extra) -> str:
        """One streamed chunk. With stream_options.include_usage each has `usage`, null until the last (OpenAI's)."""
        if self.job.prompt.include_usage:
            extra = {"usage": None, **extra}
        return sse(self.body(choice, **extra))

    def answer(self, done: dict) -> dict:
        logprobs = done.get("logprobs") and completion_logprobs(self.job.tokenizer, *done["logprobs"])
        return self.body({"text": done["text"], "finish_reason": done["finish_reason"], "logprobs": logprobs},
                         usage=usage(self.job.prompt, done), tandem=tandem_fields(done))

    def logprobs(self, value) -> list[str]:
        """Streamed: the log-probabilities of the tokens whose text comes next (Running.relay); they go with it."""
        self.scored.append(value)
        return []

    def take_logprobs(self) -> dict | None:
        """The waiting logprobs, written for this endpoint (None when none wait)."""
        if not self.scored:
            return None
        tokens = [t for ts, _ in self.scored for t in ts]
        rows = [r for _, rs in self.scored for r in rs]
        self.scored = []
        return self.write_logprobs(tokens, rows)

    def write_logprobs(self, tokens, rows) -> dict:
        logprobs = completion_logprobs(self.job.tokenizer, tokens, rows, offset=self.offset)
        self.offset += sum(map(len, logprobs["tokens"]))
        return logprobs

    def start(self) -> list[str]:
        return []

    def text(self, delta: str) -> list[str]:
        return [self.chunk({"text": delta, "logprobs": self.take_logprobs(), "finish_reason": None})]

    def last(self, done: dict) -> dict:
        """Beside finish_reason: the usage (unless it comes in a chunk of its own) and Tandem's figures."""
        return {"usage": None if self.job.prompt.include_usage else usage(self.job.prompt, done),
                "tandem": tandem_fields(done)}

    def usage_chunk(self, done: dict) -> list[str]:
        """stream_options.include_usage: after the last choice, a chunk with `choices: []` and the usage."""
        if not self.job.prompt.include_usage:
            return []
        return [sse({**self.body(self.OPEN, usage=usage(self.job.prompt, done)), "choices": []})]

    def done(self, done: dict) -> list[str]:
        # logprobs still waiting: tokens with no text of their own (a stop string's, one that ends the answer)
        return [self.chunk({"text": "", "logprobs": self.take_logprobs(), "finish_reason": done["finish_reason"]},
                           **self.last(done))] + self.usage_chunk(done)

    def error(self, e: ApiError) -> list[str]:
        return [sse(e.body())]

    def end(self) -> list[str]:
        return ["data: [DONE]\n\n"]


class ChatForm(CompletionForm):
    """/v1/chat/completions: a chat.completion, or chat.completion.chunk deltas then [DONE]. With tools (auto),
    the calls are read out of the text as it streams and sent as tool_calls (finish_reason tool_calls)."""
    OPEN = {"delta": {}}

    def __init__(self, job: Job, model: str):
        super().__init__(job, model)
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        tools = job.prompt.tools
        self.calls = tools.parser() if tools is not None and tools.parse else None

    def body(self, choice: dict, **extra) -> dict:
        streamed = "delta" in choice
        return {"id": self.id, "object": "chat.completion.chunk" if streamed else "chat.completion",
                "created": self.created, "model": self.model, "choices": [{"index": 0, "logprobs": None, **choice}],
                **extra}

    def finish_reason(self, done: dict) -> str:
        return finish_reason(self.calls, done["finish_reason"])

    def answer(self, done: dict) -> dict:
        message = {"role": "assistant", "content": done["text"]}
        if self.calls is not None:
            items = self.calls.feed(done["text"]) + self.calls.finish()
            calls = [item.openai() for kind, item in items if kind == "call"]
            message["content"] = "".join(item for kind, item in items if kind == "content") or (None if calls else "")
            if calls:
                message["tool_calls"] = calls
        logprobs = done.get("logprobs") and chat_logprobs(self.job.tokenizer, *done["logprobs"])
        return self.body({"message": message, "finish_reason": self.finish_reason(done), "logprobs": logprobs},
                         usage=usage(self.job.prompt, done), tandem=tandem_fields(done))

    def write_logprobs(self, tokens, rows) -> dict:
        return chat_logprobs(self.job.tokenizer, tokens, rows)

    def start(self) -> list[str]:
        return [self.chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})]

    def text(self, delta: str) -> list[str]:
        return self.deltas([("content", delta)] if self.calls is None else self.calls.feed(delta))

    def deltas(self, items) -> list[str]:
        """Content as it is (with the logprobs of its tokens); a call as OpenAI streams one: its id and name
        (arguments ""), then its arguments."""
        out = []
        for kind, item in items:
            if kind == "content":
                out.append(self.chunk({"delta": {"content": item}, "logprobs": self.take_logprobs(), "finish_reason": None}))
                continue
            index = self.calls.calls.index(item)
            head = {"index": index, "id": item.id, "type": "function", "function": {"name": item.name, "arguments": ""}}
            for call in (head, {"index": index, "function": {"arguments": item.arguments}}):
                out.append(self.chunk({"delta": {"tool_calls": [call]}, "finish_reason": None}))
        return out

    def done(self, done: dict) -> list[str]:
        rest = self.deltas(self.calls.finish()) if self.calls is not None else []
        return rest + [self.chunk({"delta": {}, "logprobs": self.take_logprobs(), "finish_reason": self.finish_reason(done)},
                                  **self.last(done))] + self.usage_chunk(done)


def _choice_echo(tools) -> str | dict:
    """tool_choice as the Responses API reports it back."""
    if tools is None or not tools.parse:
        return "none"
    if tools.forced is None:
        return "auto"
    return "required" if tools.forced == "*" else {"type": "function", "name": tools.forced}


class ResponsesForm:
    """The Response object, or its stream of typed events (see the module's docstring). Both are made by the same
    steps: the answer's text (read for calls when the request has tools) opens, fills and closes output items."""

    def __init__(self, job, model: str):
        self.job, self.model = job, model
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        tools = job.prompt.tools
        self.calls = tools.parser() if tools is not None and tools.parse else None
        self.sequence = 0
        self.fed = ""  # the answer's text so far
        self.output: list[dict] = []  # the output items so far
        self.message: dict | None = None  # the message item being written

    # -- the whole answer, or the stream's events ---------------------------------------------------------
    def answer(self, done: dict) -> dict:
        self.done(done)  # the same steps as a stream's, whose events are not sent
        return self.final(done)

    def start(self) -> list[str]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def text(self, delta: str) -> list[str]:
        self.fed += delta
        return self.take(self.calls.feed(delta) if self.calls is not None else [("content", delta)])

    def done(self, done: dict) -> list[str]:
        rest = done["text"][len(self.fed):] if done["text"].startswith(self.fed) else ""
        out = self.text(rest) if rest else []
        out += self.take(self.calls.finish()) if self.calls is not None else []
        if not self.output and self.message is None:  # an empty answer is still a message
            out += self.open_message()
        out += self.close_message(self.status(done))
        return out + [self.event(f"response.{self.status(done)}", response=self.final(done))]

    def error(self, e: ApiError) -> list[str]:
        failed = self.response("failed")
        failed["error"] = {"code": "server_error", "message": e.message}
        return [self.event("error", code=e.code or e.type, message=e.message, param=e.param),
                self.event("response.failed", response=failed)]

    def end(self) -> list[str]:
        return []  # the Responses API's stream ends with its last event, no [DONE]

    # -- the output items ---------------------------------------------------------------------------------
    def take(self, items) -> list[str]:
        out = []
        for kind, item in items:
            if kind == "content":
                out += self.message_text(item)
            else:
                out += self.close_message("completed") + self.function_call(item)
        return out

    def message_text(self, delta: str) -> list[str]:
        out = self.open_message() if self.message is None else []
        self.message["content"][0]["text"] += delta
        return out + [self.event("response.output_text.delta", **self.where(), delta=delta, logprobs=[])]

    def open_message(self) -> list[str]:
        self.message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
        self.output.append(self.message)
        events = [self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(self.message))]
        self.message["content"].append(self.part(""))
        return events + [self.event("response.content_part.added", **self.where(), part=self.part(""))]

    def close_message(self, status: str) -> list[str]:
        if self.message is None:
            return []
        message, self.message = self.message, None
        message["status"], text = status, message["content"][0]["text"]
        where = {"item_id": message["id"], "output_index": self.output.index(message), "content_index": 0}
        return [self.event("response.output_text.done", **where, text=text, logprobs=[]),
                self.event("response.content_part.done", **where, part=self.part(text)),
                self.event("response.output_item.done", output_index=where["output_index"], item=message)]

    def function_call(self, call) -> list[str]:
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call.id, "name": call.name,
                "arguments": "", "status": "in_progress"}
        self.output.append(item)
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        events = [self.event("response.output_item.added", output_index=where["output_index"], item=dict(item))]
        item.update(arguments=call.arguments, status="completed")
        return events + [self.event("response.function_call_arguments.delta", **where, delta=call.arguments),
                         self.event("response.function_call_arguments.done", **where, arguments=call.arguments),
                         self.event("response.output_item.done", output_index=where["output_index"], item=item)]

    # -- shapes ---------------------------------------------------------------------------------------------
    def response(self, status: str, output: list[dict] | None = None) -> dict:
        params, tools = self.job.prompt.params, self.job.prompt.tools
        specs = tools.specs if tools is not None and tools.specs else []
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
                "output": output or [], "error": None, "incomplete_details": None, "instructions": None, "metadata": {},
                "parallel_tool_calls": tools.parallel if tools is not None else True,
                "tool_choice": _choice_echo(tools),
                "tools": [{"type": "function", "strict": False, "parameters": None, **s["function"]} for s in specs],
                "temperature": params.temperature, "top_p": params.top_p,
                "max_output_tokens": self.job.prompt.max_tokens, "text": {"format": {"type": "text"}}, "usage": None}

    def final(self, done: dict) -> dict:
        body = self.response(self.status(done), self.output)
        if body["status"] == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        n_in, n_out = len(self.job.prompt.ids), len(done["token_ids"])
        body["usage"] = {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out,
                         "input_tokens_details": {"cached_tokens": done["stats"]["prompt_tokens_reused"],
                                                  "cache_write_tokens": 0},
                         "output_tokens_details": {"reasoning_tokens": 0}}
        body["tandem"] = tandem_fields(done)
        return body

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def status(done: dict) -> str:
        return "incomplete" if done["finish_reason"] == "length" else "completed"

    def where(self) -> dict:
        return {"item_id": self.message["id"], "output_index": self.output.index(self.message), "content_index": 0}

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
