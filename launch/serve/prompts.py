"""Each endpoint's body into one Prompt: /v1/chat/completions (parse_chat), /v1/completions (parse_completion),
/v1/responses (parse_responses), with the fields of launch/serve/fields.py, the tools of launch/serve/tools.py and
the structured outputs of launch/serve/structured.py; a field that cannot be served is a FieldError (a 400 naming
it).

The Responses API (what the newer OpenAI SDKs and agent tools call) runs on the same engine as chat: its `input`
(a string, or a list of items: messages {role, content} whose content is a string or input_text / output_text
parts, function_call and function_call_output items) becomes a conversation, `instructions` a system message
before it, and it goes through the same chat template; `max_output_tokens`, `temperature`, `top_p`, `stream`,
and function `tools` with `tool_choice` and `parallel_tool_calls` are read as on chat. Everything else follows
the field table: inert values are accepted, the rest is a 400 naming the field (previous_response_id,
store=true, text formats other than plain text...).
"""
from __future__ import annotations

from launch.build import TemplateRefused, chat_template_ids
from launch.serve.errors import ApiError, FieldError
from launch.serve.fields import Prompt, check_fields, integer_field, read_settings, with_ids
from launch.serve.structured import read_chat_logprobs, read_completion_logprobs, read_grammar
from launch.serve.tools import CLOSE, ToolSetup, template_message, tool_setup


def parse_chat(body, tokenizer, cfg, model_name: str) -> Prompt:
    _check_common(body, model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise FieldError("messages must be a non-empty list of {role, content}", param="messages")
    if tokenizer is None or not tokenizer.chat_template:
        raise FieldError(f"{model_name} has no chat template: use /v1/completions", param="messages")
    tools = tool_setup(body, tokenizer.chat_template)
    conversation = [template_message(m, _role(m), _content(m)) for m in messages]
    settings = read_settings(body, cfg)
    check_fields(body, "chat")
    settings.params.grammar, settings.params.logprobs = read_grammar(body, tokenizer), read_chat_logprobs(body)
    settings.params.grammar = forced_call(tools, tokenizer, settings.params.grammar)
    prompt = with_ids(settings, template_ids(tokenizer, conversation, tools.specs if tools else None))
    prompt.tools = tools
    if tools and tools.parse and not tools.parallel:
        prompt.stop = [*prompt.stop, CLOSE]  # one call (parallel_tool_calls=false): the answer ends with it
    return prompt


def forced_call(tools: ToolSetup | None, tokenizer, grammar: str | None) -> str | None:
    """The request's grammar once tool_choice required / named holds the answer to a call (launch/serve/tools.py)."""
    if tools is None or tools.forced is None:
        return grammar
    if grammar is not None:
        raise FieldError("tool_choice required or a named function already constrains the answer to a call: "
                         "drop response_format", param="response_format")
    try:
        return tools.grammar(tokenizer)
    except ValueError as e:  # speculative.grammar.GrammarError: a tool's parameters no grammar can hold
        raise FieldError(f"the tools' parameters cannot be enforced: {e}", param="tools") from None


def template_ids(tokenizer, conversation: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The conversation (and the tools) through the model's chat template, ready for the assistant's answer
    (launch.build.chat_template_ids, which the entry's prompt uses too); a refusal is a 400 naming messages."""
    try:
        return chat_template_ids(tokenizer, conversation, tools)
    except TemplateRefused as e:
        raise FieldError(str(e), param="messages") from None


def parse_completion(body, tokenizer, cfg, model_name: str) -> Prompt:
    _check_common(body, model_name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    settings = read_settings(body, cfg)
    check_fields(body, "completions")
    settings.params.logprobs = read_completion_logprobs(body)
    if isinstance(prompt, str) and prompt:
        if tokenizer is None:
            raise FieldError(f"{model_name} has no tokenizer: send the prompt as a list of token ids", param="prompt")
        ids = tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise FieldError("prompt must be a non-empty string or a list of token ids (one prompt per request)",
                         param="prompt")
    return with_ids(settings, ids)


def check_model(body, model_name: str) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("model") not in (None, model_name):
        raise ApiError(404, f"the model {str(body.get('model'))[:100]!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")


def _check_common(body, model_name: str) -> None:
    check_model(body, model_name)
    if integer_field(body, "n", 1, 1, 1) != 1:
        raise FieldError("n must be 1: one answer per request", param="n")
    integer_field(body, "best_of", 1, 1, 1)  # one answer per request (n, best_of); logprobs and echo: INERT


def _role(message) -> str:
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise FieldError(f"each message needs a role of system, user, assistant or tool (got {str(role)[:40]!r})",
                         param="messages")
    return "system" if role == "developer" else role


def _content(message) -> str | None:
    content = message.get("content")
    if content is None and message.get("role") == "assistant" and message.get("tool_calls"):
        return None  # an assistant turn that only called tools
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise FieldError("only text content parts are supported", param="messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise FieldError("each message needs a string content", param="messages")
    return content


# --- /v1/responses --------------------------------------------------------------------------------------------
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}

PART_TYPES = ("input_text", "output_text", "text")


def parse_responses(body, tokenizer, cfg, model_name: str) -> Prompt:
    check_model(body, model_name)
    if tokenizer is None or not tokenizer.chat_template:
        raise FieldError(f"{model_name} has no chat template: use /v1/completions", param="input")
    try:
        tools = tool_setup(_as_chat_tools(body), tokenizer.chat_template)
        conversation = [template_message(m, m["role"], m["content"]) for m in _conversation(body.get("input"))]
    except FieldError as e:  # the Responses API's conversation is its input
        e.param = "input" if e.param == "messages" else e.param
        raise
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise FieldError("instructions must be a string", param="instructions")
        conversation.insert(0, {"role": "system", "content": instructions})
    settings = read_settings(body, cfg)
    check_fields(body, "responses")
    settings.params.grammar = forced_call(tools, tokenizer, settings.params.grammar)
    prompt = with_ids(settings, template_ids(tokenizer, conversation, tools.specs if tools else None))
    prompt.tools = tools
    return prompt


def _as_chat_tools(body: dict) -> dict:
    """The Responses API's tool fields in chat's form ({type: function, name, ...} -> {type: function, function})."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if isinstance(tools, list):
        if not all(isinstance(t, dict) and t.get("type") == "function" for t in tools):
            raise FieldError("only function tools are supported (no web_search, file_search, computer or mcp tools)",
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
        raise FieldError("input must be a non-empty string or a list of messages {role, content}", param="input")
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
                raise FieldError("a function_call_output's output must be a string", param="input")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind == "message":
            messages.append(_message(item))
        else:
            raise FieldError(f"input items of type {str(kind)[:40]!r} are not supported: send messages, "
                             "function_call and function_call_output items", param="input")
    return messages


def _message(item: dict) -> dict:
    role = ROLES.get(item.get("role")) if isinstance(item.get("role"), str) else None
    if role is None:
        raise FieldError("each input message needs a role of user, assistant, system or developer", param="input")
    content = item.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") in PART_TYPES and isinstance(p.get("text"), str) for p in content):
            raise FieldError("only text content parts (input_text, output_text) are supported", param="input")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise FieldError("each input message needs a string content or a list of text parts", param="input")
    return {"role": role, "content": content}
