"""POST /v1/responses: the Responses API (what the newer OpenAI SDKs and agent tools call), on the same engine as
/v1/chat/completions: the input becomes a conversation, goes through the same chat template, and is queued as
one more request behind the same API key check and limits.

Read: `input` (a string, or a list of messages {role, content} whose content is a string or input_text /
output_text parts), `instructions` (a system message before them), `max_output_tokens`, `temperature`,
`top_p`, `stream`. Everything else follows launch/api.py's field table: inert values are accepted, the rest
is a 400 naming the field (tools, previous_response_id, store=true, text formats other than plain text...).

A streamed response is the typed events OpenAI sends (no [DONE]): response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, response.output_item.done, then response.completed (or response.incomplete when
max_output_tokens cut it; an error event and response.failed when the server could not finish).
"""
from __future__ import annotations

import json
import time
import uuid

from launch.api import ApiError, Prompt, check_fields, check_model, read_settings, tandem_fields, template_ids, with_ids

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
PART_TYPES = ("input_text", "output_text", "text")


def parse_responses(body, tokenizer, cfg, model_name: str) -> Prompt:
    check_model(body, model_name)
    if tokenizer is None or not tokenizer.chat_template:
        raise ApiError(400, f"{model_name} has no chat template: use /v1/completions", param="input")
    conversation = _conversation(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, "instructions must be a string", param="instructions")
        conversation.insert(0, {"role": "system", "content": instructions})
    settings = read_settings(body, cfg)
    check_fields(body, "responses")
    return with_ids(settings, template_ids(tokenizer, conversation))


def _conversation(given) -> list[dict]:
    if isinstance(given, str) and given:
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise ApiError(400, "input must be a non-empty string or a list of messages {role, content}", param="input")
    return [_message(item) for item in given]


def _message(item) -> dict:
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise ApiError(400, f"input items of type {str(kind)[:40]!r} are not supported: send messages {{role, content}}",
                       param="input")
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
    """The Response object, or its stream of typed events (see the module's docstring)."""

    def __init__(self, job, model: str):
        self.job, self.model = job, model
        self.id, self.item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sequence = 0
        self.sent = ""

    def response(self, status: str, output: list[dict], done: dict | None = None) -> dict:
        request = self.job.prompt.request
        body = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
                "output": output, "error": None, "incomplete_details": None, "instructions": None, "metadata": {},
                "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "temperature": request.temperature,
                "top_p": request.top_p, "max_output_tokens": self.job.prompt.max_tokens, "text": {"format": {"type": "text"}},
                "usage": None}
        if done is not None:
            if status == "incomplete":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            n_in, n_out = len(self.job.prompt.ids), len(done["token_ids"])
            body["usage"] = {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out,
                             "input_tokens_details": {"cached_tokens": done["stats"]["prompt_tokens_reused"],
                                                      "cache_write_tokens": 0},
                             "output_tokens_details": {"reasoning_tokens": 0}}
            body["tandem"] = tandem_fields(done)
        return body

    def part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def item(self, status: str, content: list[dict]) -> dict:
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    @staticmethod
    def status(done: dict) -> str:
        return "incomplete" if done["finish_reason"] == "length" else "completed"

    def answer(self, done: dict) -> dict:
        status = self.status(done)
        return self.response(status, [self.item(status, [self.part(done["text"])])], done)

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def where(self, content: bool = True) -> dict:
        return {"item_id": self.item_id, "output_index": 0, **({"content_index": 0} if content else {})}

    def start(self) -> list[str]:
        return [self.event("response.created", response=self.response("in_progress", [])),
                self.event("response.in_progress", response=self.response("in_progress", [])),
                self.event("response.output_item.added", output_index=0, item=self.item("in_progress", [])),
                self.event("response.content_part.added", **self.where(), part=self.part(""))]

    def text(self, delta: str) -> list[str]:
        self.sent += delta
        return [self.event("response.output_text.delta", **self.where(), delta=delta, logprobs=[])]

    def done(self, done: dict) -> list[str]:
        text, status = done["text"], self.status(done)
        out = self.text(text[len(self.sent):]) if len(text) > len(self.sent) else []
        return out + [self.event("response.output_text.done", **self.where(), text=text, logprobs=[]),
                      self.event("response.content_part.done", **self.where(), part=self.part(text)),
                      self.event("response.output_item.done", output_index=0, item=self.item(status, [self.part(text)])),
                      self.event(f"response.{status}", response=self.answer(done))]

    def error(self, e: ApiError) -> list[str]:
        failed = self.response("failed", [])
        failed["error"] = {"code": "server_error", "message": e.message}
        return [self.event("error", code=e.code or e.type, message=e.message, param=e.param),
                self.event("response.failed", response=failed)]

    def end(self) -> list[str]:
        return []  # the Responses API's stream ends with its last event, no [DONE]
