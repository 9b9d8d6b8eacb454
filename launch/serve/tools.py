"""Tool calls on /v1/chat/completions: the request's `tools`, `tool_choice` and `parallel_tool_calls` checked,
the conversation's tool messages put in the form chat templates read, and the model's calls read back out of
the generated text.

The tools are rendered by the model's own chat template (transformers' apply_chat_template(tools=...)), so the
model sees them exactly as it was trained to. The calls come back in the model family's own format; the one
read here is the Hermes format of Qwen2.5 and Qwen3 (a template that mentions `<tool_call>`):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Qwen2.5-Coder often leaves the tags out and answers with the call alone, bare or in a ```json fence (the
embedded 0.5B and 1.5B both do, asked about the weather with a get_weather tool): an answer that is nothing but
{"name": <a tool's name>, "arguments": {...}} (or a list of them) is read as calls too. Such an answer cannot be
told from text until it ends, so an answer that begins with { or ``` is sent when it ends.

tool_choice auto parses that text; none leaves the tools out of the prompt (nothing can call them). required
and a named function constrain decoding to a call: the request carries call_grammar (the tags around
call_schema's JSON), which the last rank enforces where it verifies (speculative.grammar), so the answer is a
call that parses, of the named tool when one is named.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from launch.serve.errors import FieldError
from speculative.grammar import JSON_OPTIONS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name


@dataclass
class ToolSetup:
    """What a request asks of tools: `specs` go to the chat template (None: no tools in the prompt); `parse`:
    read calls out of the answer; `parallel`: more than one call per answer."""
    specs: list[dict] | None
    parse: bool
    parallel: bool = True
    forced: str | None = None  # tool_choice required ("*": any tool) or the named tool: the answer must be a call

    def grammar(self, tokenizer) -> str | None:
        """The grammar the answer is held to (tool_choice required / named), as llguidance's source, tried on its
        first tokens as the last rank will use it (launch.serve.structured.check_grammar); else None."""
        if self.forced is None:
            return None
        from launch.serve.structured import check_grammar
        from speculative.grammar import lark_source
        name = None if self.forced == "*" else self.forced
        source = lark_source(call_grammar(self.specs, tokenizer, name, self.parallel))
        return check_grammar(source, tokenizer, call_schema(self.specs, name))

    def parser(self) -> CallParser:
        return CallParser(self.parallel, frozenset(s["function"]["name"] for s in self.specs or []),
                          forced=self.forced is not None)


def tool_setup(body: dict, chat_template: str | None) -> ToolSetup | None:
    """The request's tool fields checked (None: it has none)."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise FieldError(f"{legacy} is the deprecated form of tools; send tools and tool_choice", legacy)
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise FieldError("tool_choice names a tool but the request has no tools", "tool_choice")
        return None
    specs = _specs(tools)
    names = [s["function"]["name"] for s in specs]
    if choice is None or choice == "auto":
        forced = None
    elif choice == "none":
        return ToolSetup(None, False)
    elif choice == "required" or _named(choice, names):
        forced = "*" if choice == "required" else choice["function"]["name"]
    else:
        raise FieldError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
                         "tool_choice")
    if not chat_template or "tools" not in chat_template:
        raise FieldError("this model's chat template does not render tools", "tools")
    if OPEN not in chat_template:
        raise FieldError(f"this model's tool-call format is not one this server reads (it reads {OPEN} JSON, as "
                         "Qwen2.5 and Qwen3 write it)", "tools")
    return ToolSetup(specs, True, parallel is not False, forced)


def _specs(tools) -> list[dict]:
    if not isinstance(tools, list) or len(tools) > 128:
        raise FieldError("tools must be a list of up to 128 {type: function, function: {name, description, parameters}}",
                         "tools")
    specs, seen = [], set()
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not NAME.match(function["name"]):
            raise FieldError("each tool must be {type: function, function: {name, ...}} with a name of letters, digits, "
                             "_ or - (at most 64)", "tools")
        if not isinstance(function.get("description", ""), str) or not isinstance(function.get("parameters", {}), dict):
            raise FieldError(f"tool {function['name']}: description must be a string and parameters a JSON schema object",
                             "tools")
        if function["name"] in seen:
            raise FieldError(f"two tools are named {function['name']}", "tools")
        seen.add(function["name"])
        specs.append({"type": "function", "function": {k: function[k] for k in ("name", "description", "parameters")
                                                       if k in function}})
    return specs


def _named(choice, names: list[str]) -> bool:
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)):
        return False
    if choice["function"].get("name") not in names:
        raise FieldError(f"tool_choice names {str(choice['function'].get('name'))[:64]!r}, which is not in tools", "tool_choice")
    return True


def call_schema(specs: list[dict], name: str | None = None) -> dict:
    """The JSON schema of the object inside <tool_call>...</tool_call>: any of the tools (tool_choice required) or
    the named one, with its parameters as the arguments' schema. What a grammar enforces for required / named:
    JSON written as the chat template writes a call (", " and ": ", no other whitespace; "x-guidance" is where
    llguidance reads its options inside a grammar), so a model cannot pad a call with whitespace to max_tokens."""
    options = [{"type": "object", "properties": {"name": {"const": s["function"]["name"]},
                                                 "arguments": s["function"].get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}
               for s in specs if name is None or s["function"]["name"] == name]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_OPTIONS}


def call_grammar(specs: list[dict], tokenizer, name: str | None = None, parallel: bool = True) -> str:
    """The llguidance (Lark) grammar of an answer that is only calls: <tool_call>, a newline, call_schema's JSON,
    a newline, </tool_call> (one call, or several separated by newlines when `parallel`). A tag that is one token
    of the tokenizer (Qwen's added tokens) is written as that token, else as its text. What tool_choice required /
    named hand to the grammar (speculative.grammar)."""
    def tag(text: str) -> str:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)
    calls = 'call ("\\n" call)*' if parallel else "call"
    return (f"start: {calls}\ncall: {tag(OPEN)} \"\\n\" body \"\\n\" {tag(CLOSE)}\n"
            f"body: %json {json.dumps(call_schema(specs, name))}\n")


def template_message(message: dict, role: str, content: str | None) -> dict:
    """One message as chat templates read it: an assistant's tool_calls with their arguments as objects (Qwen's
    template writes `arguments | tojson`: a JSON string there would be encoded twice); a tool result keeps its id."""
    out = {"role": role, "content": content}
    if isinstance(message.get("name"), str):  # a participant's (or a tool's) name: for the templates that show it
        out["name"] = message["name"]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise FieldError("a tool message needs the tool_call_id of the call it answers", "messages")
        out["tool_call_id"] = call_id
    elif role == "assistant" and message.get("tool_calls") is not None:
        out["tool_calls"] = [_template_call(c) for c in _list(message["tool_calls"])]
    return out


def _list(calls) -> list:
    if not isinstance(calls, list) or not calls:
        raise FieldError("an assistant message's tool_calls must be a non-empty list", "messages")
    return calls


def _template_call(call) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not isinstance(function.get("arguments"), str):
        raise FieldError("each tool call needs {id, type: function, function: {name, arguments: a JSON string}}", "messages")
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError):
        raise FieldError(f"the arguments of the call to {function['name'][:64]} are not JSON", "messages") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


@dataclass
class Call:
    id: str
    name: str
    arguments: str  # a JSON string, as OpenAI sends it

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class CallParser:
    """Reads <tool_call> JSON </tool_call> out of the answer as it streams. feed(text) returns what is decided:
    ("content", text) and ("call", Call) items in order; finish() the rest. Text that may be the start of a
    <tool_call> waits until it is decided; whitespace just before a call or after the last one is dropped (the
    text is then the message around the calls); a call whose JSON does not parse is given back as text, but one
    cut off at the end (no </tool_call>: max_tokens stopped it) is dropped, so no part of a call is content.
    With `names`, an answer that begins with { or ``` is held to its end and read as bare calls (see above).
    `forced` (tool_choice required / named): the grammar holds the answer to calls, so nothing is content."""
    parallel: bool = True
    names: frozenset = frozenset()  # the tools a bare call may name (none: bare calls are not read)
    forced: bool = False
    calls: list[Call] = field(default_factory=list)
    _pending: str = ""  # not yet decided: a possible tag start, or a call's body until its </tool_call>
    _space: str = ""  # whitespace outside calls, held until it is known whether a call follows
    _in_call: bool = False
    _bare: bool | None = None  # whether the answer may be a bare call (None: its first characters not yet seen)
    _head: str = ""  # the answer so far while _bare is not False

    def feed(self, text: str) -> list[tuple[str, object]]:
        if self._bare is not False:
            self._head += text
            start = self._head.lstrip()
            if not start or (self.names and "```".startswith(start)):
                return []  # not yet known
            self._bare = bool(self.names) and start.startswith(("{", "```"))
            if self._bare:
                return []  # held to the end
            text, self._head = self._head, ""
        self._pending += text
        out: list[tuple[str, object]] = []
        while not (self.calls and not self.parallel):
            if self._in_call:
                end = self._pending.find(CLOSE)
                if end < 0:
                    break
                out += self._call(self._pending[:end], self._pending[:end + len(CLOSE)])
                self._pending, self._in_call = self._pending[end + len(CLOSE):], False
                continue
            start = self._pending.find(OPEN)
            if start < 0:
                decided = len(self._pending) - _tag_start(self._pending)
                out += self._text(self._pending[:decided])
                self._pending = self._pending[decided:]
                break
            out += self._text(self._pending[:start])
            self._pending, self._in_call = self._pending[start + len(OPEN):], True
        if self.calls and not self.parallel:
            self._pending = ""  # one call asked for (parallel_tool_calls=false): nothing after it is read
        return out

    def finish(self) -> list[tuple[str, object]]:
        """The end of the answer: an unclosed call is read as far as it goes (a stop string may have cut its
        </tool_call>), and dropped when its JSON is incomplete; held whitespace is content unless calls were made."""
        if self._bare is not False:  # the whole answer was held: bare calls, or else text as it came
            answer, self._head, self._bare = self._head, "", False
            calls = bare_calls(answer, self.names)
            if calls:
                self.calls = calls[:1] if not self.parallel else calls
                return [("call", call) for call in self.calls]
            return self.feed(answer) + self.finish()
        rest, self._pending = self._pending, ""
        out = self._call(rest, None) if self._in_call else self._text(rest)
        self._in_call = False
        if self._space and not self.calls and not self.forced:
            out.append(("content", self._space))
        self._space = ""
        return out

    def _text(self, text: str) -> list[tuple[str, object]]:
        if not text or self.forced:  # forced: only "\n" between calls, or the start of a tag max_tokens cut
            return []
        text, self._space = self._space + text, ""
        body = text.rstrip()
        self._space = text[len(body):]
        return [("content", body)] if body else []

    def _call(self, body: str, raw: str | None) -> list[tuple[str, object]]:
        """A call's body read; `raw`: its text up to its </tool_call> (None: cut off, no </tool_call>)."""
        call = parse_call(body)
        if call is None:
            held, self._space = self._space, ""
            if raw is None or self.forced:  # cut off by max_tokens (or held to calls by the grammar): dropped
                return []
            return [("content", held + OPEN + raw)]  # given back as it was written, with the whitespace before it
        self._space = ""
        self.calls.append(call)
        return [("call", call)]


def finish_reason(parser: CallParser | None, reason: str) -> str:
    """OpenAI's finish_reason of a chat answer whose own is `reason` (stop, length): tool_calls when it made calls
    and ended by itself; length whenever max_tokens stopped it, calls or not (a call it cut off is dropped)."""
    return "tool_calls" if parser is not None and parser.calls and reason != "length" else reason


def parse_call(body: str) -> Call | None:
    """{"name": ..., "arguments": {...}} (Qwen; some models write "parameters"); None when it is not one."""
    data = _json(body)
    return _call_of(data) if isinstance(data, dict) and isinstance(data.get("name"), str) else None


FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.S)


def bare_calls(answer: str, names: frozenset) -> list[Call] | None:
    """The calls of an answer that is nothing but {"name", "arguments"} objects (one, or a list) naming tools of
    `names`, bare or in one ```json fence; None for any other answer."""
    body = answer.strip()
    fenced = FENCE.fullmatch(body)
    data = _json(fenced.group(1) if fenced else body)
    items = data if isinstance(data, list) else [data]
    if not items or not all(isinstance(d, dict) and d.get("name") in names and set(d) <= {"name", "arguments", "parameters"}
                            for d in items):
        return None
    return [_call_of(d) for d in items]


def _json(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _call_of(data: dict) -> Call:
    arguments = data.get("arguments", data.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return Call(f"call_{uuid.uuid4().hex[:24]}", data["name"], arguments)


def _tag_start(text: str) -> int:
    """How many characters at the end of `text` could begin <tool_call>."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0
