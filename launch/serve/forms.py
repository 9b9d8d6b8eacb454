"""POST /v1/responses: the Responses API (what the newer OpenAI SDKs and agent tools call), on the same engine as
/v1/chat/completions: the input becomes a conversation, goes through the same chat template, and is queued as
one more request behind the same API key check and limits.

Read: `input` (a string, or a list of items: messages {role, content} whose content is a string or input_text /
output_text parts, function_call and function_call_output items), `instructions` (a system message before
them), `max_output_tokens`, `temperature`, `top_p`, `stream`, and function `tools` with `tool_choice` and
`parallel_tool_calls` (as on chat, launch/tools.py: auto and none parse the answer; required and a named function
hold it to calls by a grammar). Everything else follows launch/api.py's field table: inert values are accepted, the
rest is a 400 naming the field (previous_response_id, store=true, text formats other than plain text...).

The output is a message item for the text and a function_call item per call. A streamed response is the typed
events OpenAI sends (no [DONE]): response.created, response.in_progress, then per item
response.output_item.added, for a message response.content_part.added, response.output_text.delta...,
response.output_text.done, response.content_part.done, for a call response.function_call_arguments.delta and
.done, then response.output_item.done; last response.completed (or response.incomplete when max_output_tokens
cut it; an error event and response.failed when the server could not finish).
"""
from __future__ import annotations

import json
import time
import uuid

from launch.api import (ApiError, Prompt, check_fields, check_model, forced_call, read_settings, tandem_fields,
                        template_ids, with_ids)
from launch.tools import ToolError, template_message, tool_setup

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
PART_TYPES = ("input_text", "output_text", "text")


def parse_responses(body, tokenizer, cfg, model_name: str) -> Prompt:
    check_model(body, model_name)
    if tokenizer is None or not tokenizer.chat_template:
        raise ApiError(400, f"{model_name} has no chat template: use /v1/completions", param="input")
    try:
        tools = tool_setup(_as_chat_tools(body), tokenizer.chat_template)
        conversation = [template_message(m, m["role"], m["content"]) for m in _conversation(body.get("input"))]
    except ToolError as e:
        raise ApiError(400, str(e), param="input" if e.param == "messages" else e.param) from None
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, "instructions must be a string", param="instructions")
        conversation.insert(0, {"role": "system", "content": instructions})
    settings = read_settings(body, cfg)
    check_fields(body, "responses")
    settings.request.grammar = forced_call(tools, tokenizer, settings.request.grammar)
    prompt = with_ids(settings, template_ids(tokenizer, conversation, tools.specs if tools else None))
    prompt.tools = tools
    return prompt


def _choice_echo(tools) -> str | dict:
    """tool_choice as the Responses API reports it back."""
    if tools is None or not tools.parse:
        return "none"
    if tools.forced is None:
        return "auto"
    return "required" if tools.forced == "*" else {"type": "function", "name": tools.forced}


def _as_chat_tools(body: dict) -> dict:
    """The Responses API's tool fields in chat's form ({type: function, name, ...} -> {type: function, function})."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if isinstance(tools, list):
        if not all(isinstance(t, dict) and t.get("type") == "function" for t in tools):
            raise ToolError("only function tools are supported (no web_search, file_search, computer or mcp tools)",
                            "tools")
        tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": body.get("parallel_tool_calls")}


def _conversation(given) -> list[dict]:
    """The input as chat messages; consecutive function_call items make one assistant turn, as chat sends them."""
    if isinstance(given, str) and given:
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise ApiError(400, "input must be a non-empty string or a list of messages {role, content}", param="input")
    messages: list[dict] = []
    for item in given:
        kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
        if kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if messages and messages[-1].get("tool_calls") and messages[-1]["content"] is None:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise ApiError(400, "a function_call_output's output must be a string", param="input")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind == "message":
            messages.append(_message(item))
        else:
            raise ApiError(400, f"input items of type {str(kind)[:40]!r} are not supported: send messages, "
                                "function_call and function_call_output items", param="input")
    return messages


def _message(item: dict) -> dict:
    role = ROLES.get(item.get("role")) if isinstance(item.get("role"), str) else None
    if role is None:
        raise ApiError(400, "each input message needs a role of user, assistant, system or developer", param="input")
    content = item.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") in PART_TYPES and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, "only text content parts (input_text, output_text) are supported", param="input")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, "each input message needs a string content or a list of text parts", param="input")
    return {"role": role, "content": content}


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
        request, tools = self.job.prompt.request, self.job.prompt.tools
        specs = tools.specs if tools is not None and tools.specs else []
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
                "output": output or [], "error": None, "incomplete_details": None, "instructions": None, "metadata": {},
                "parallel_tool_calls": tools.parallel if tools is not None else True,
                "tool_choice": _choice_echo(tools),
                "tools": [{"type": "function", "strict": False, "parameters": None, **s["function"]} for s in specs],
                "temperature": request.temperature, "top_p": request.top_p,
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
