"""Issue 30: tool calls on /v1/chat/completions, through the real `openai` client against the real server in
process (tests.support.serve_harness). The model is a tiny Qwen2 made to write scripted answers: its layers add
nothing (zero output projections), each scripted token's embedding is its own basis vector, and the head maps
it to the next token of its script, so the greedy answer is a chain decided by the prompt's last token (the last
message's content: the template adds no generation header). Scripts include Qwen's <tool_call> format, split
across tokens the way a real answer is, and the answers are checked against transformers generate too."""
import json
from pathlib import Path

import openai
import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import AddedToken, AutoModelForCausalLM, AutoTokenizer

from launch.serve.tools import CallParser, ToolSetup, call_grammar, finish_reason
from tests.support.serve_harness import served, served_args
from tests.support.tiny_models import randomize_norms, reference_greedy, save_tiny, save_tiny_tokenizer

TEMPLATE = (
    "{%- if tools %}tools:{% for t in tools %} {{ t | tojson }}{% endfor %} (call one as <tool_call>{\"name\": ..., "
    "\"arguments\": ...}</tool_call>)<eos>{% endif %}"
    "{%- for m in messages %}{{ m.role }}: "
    "{%- for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "{%- if m.role == 'tool' %}[{{ m.tool_call_id }}] {% endif %}{{ m.content or '' }}"
    "{%- if not loop.last %}<eos>{% endif %}{% endfor %}")
SCRIPTS = {  # the last prompt token -> the answer's tokens (then <eos>)
    "<ask_weather>": ["Let me check.\n<tool", "_call>\n{\"name\": \"get_weather\", \"arguments\": ",
                      "{\"city\": \"Paris\", \"unit\": \"°C\"}}\n</tool_call>"],
    "<ask_two>": ["<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n",
                  "<tool_call>\n{\"name\": \"get_time\", ", "\"arguments\": {\"zone\": \"CET\"}}\n</tool_call>"],
    "<sunny>": ["It is sunny ", "in Paris."],
    "<ask_text>": ["Use the <tool", "kit> wisely."],
    "<ask_fenced>": ["```json\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": \"Rome\"}}\n```"],  # Qwen-Coder's way
    "<ask_json>": ["{\"name\": \"Ada\", ", "\"arguments\": 3}"],  # JSON that names no tool: text
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def scripted_model(folder: Path) -> Path:
    save_tiny_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    pieces = [p for start, answer in SCRIPTS.items() for p in (start, *answer)]
    tokenizer.add_tokens([AddedToken(p, normalized=False, special=False) for p in pieces])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    ids = {p: tokenizer.convert_tokens_to_ids(p) for p in pieces}
    eos = tokenizer.eos_token_id
    save_tiny(folder, "qwen2", seed=3, eos=eos, seed_vocab=len(tokenizer) + 8, layers=2)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hidden = model.config.hidden_size
    with torch.no_grad():
        randomize_norms(model)
        for layer in model.model.layers:  # every layer adds nothing: the last state is the token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for axis, (start, answer) in enumerate((s, [s, *a, None]) for s, a in SCRIPTS.items()):
            chain = [ids[p] if p is not None else eos for p in answer]
            for k, (token, after) in enumerate(zip(chain, chain[1:])):
                basis = torch.zeros(hidden)
                basis[4 * axis + k] = 1.0
                model.model.embed_tokens.weight[token] = basis
                model.lm_head.weight[after] += 20.0 * basis
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return scripted_model(tmp_path_factory.mktemp("tools") / "scripted")


@pytest.fixture(scope="module")
def server(model):
    with served(*served_args(model, model, "gen.max_new_tokens=32", "spec.k=2")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(model):
    return AutoTokenizer.from_pretrained(model)


def ask(client, last: str, **extra):
    return client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": f"hi {last}"}],
                                          tools=extra.pop("tools", TOOLS), **extra)


def streamed(client, last: str, **extra) -> tuple[str, dict, list]:
    """The stream reassembled as a client does: content joined, each call's pieces joined by index."""
    content, calls, chunks = "", {}, list(ask(client, last, stream=True, **extra))
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = piece.id or call["id"]
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
    return content, calls, chunks


def test_an_auto_tool_call_parses_with_its_name_and_arguments(client, server, model, tokenizer):
    r = ask(client, "<ask_weather>")
    choice = choice_of(r)
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "unit": "°C"}
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi <ask_weather>"}], tools=TOOLS,
                                        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert r.usage.prompt_tokens == len(ids)  # the tools were rendered by the template
    assert r.tandem["token_ids"] == reference_greedy(model, list(ids), 32, eos=tokenizer.eos_token_id)


def choice_of(r):
    assert len(r.choices) == 1
    return r.choices[0]


def test_streamed_tool_call_deltas_reassemble_to_the_same_call(client):
    whole = choice_of(ask(client, "<ask_weather>"))
    content, calls, chunks = streamed(client, "<ask_weather>")
    assert content == whole.message.content  # "<tool" held back until decided, never sent as text
    [call] = calls.values()
    assert call["id"].startswith("call_") and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == json.loads(whole.message.tool_calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_two_calls_and_parallel_tool_calls_false(client):
    calls = choice_of(ask(client, "<ask_two>")).message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2
    _, streamed_calls, _ = streamed(client, "<ask_two>")
    assert [c["name"] for _, c in sorted(streamed_calls.items())] == ["get_weather", "get_time"]
    one = ask(client, "<ask_two>", parallel_tool_calls=False)
    assert [c.function.name for c in choice_of(one).message.tool_calls] == ["get_weather"]
    assert one.usage.completion_tokens == 1  # the answer ended with the first call


def test_role_tool_messages_reach_the_template(client, model, tokenizer):
    asked = {"role": "user", "content": "hi <ask_weather>"}
    arguments = {"city": "Paris"}
    messages = [asked, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22 °C <sunny>"}]
    r = client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS)
    assert choice_of(r).message.content == "It is sunny in Paris." and not choice_of(r).message.tool_calls
    assert choice_of(r).finish_reason == "stop"
    expected = [asked, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22 °C <sunny>"}]
    ids = tokenizer.apply_chat_template(expected, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
    assert r.usage.prompt_tokens == len(ids)
    assert r.tandem["token_ids"] == reference_greedy(model, list(ids), 32, eos=tokenizer.eos_token_id)


def test_text_that_only_looks_like_a_call_is_content(client):
    r = ask(client, "<ask_text>")
    assert choice_of(r).message.content == "Use the <toolkit> wisely." and not choice_of(r).message.tool_calls
    assert choice_of(r).finish_reason == "stop"
    content, calls, _ = streamed(client, "<ask_text>")
    assert content == "Use the <toolkit> wisely." and not calls


def test_a_call_without_tags_alone_in_the_answer_is_a_call(client):
    """Qwen2.5-Coder (the embedded 0.5B and 1.5B) answers with the call alone, bare or in a ```json fence."""
    r = choice_of(ask(client, "<ask_fenced>"))
    assert r.finish_reason == "tool_calls" and r.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in r.message.tool_calls] == \
        [("get_weather", {"city": "Rome"})]
    content, calls, _ = streamed(client, "<ask_fenced>")
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [("get_weather", {"city": "Rome"})]
    text = '{"name": "Ada", "arguments": 3}'
    r = choice_of(ask(client, "<ask_json>"))
    assert r.message.content == text and not r.message.tool_calls and r.finish_reason == "stop"
    assert streamed(client, "<ask_json>")[:2] == (text, {})


def test_tool_choice_none_leaves_the_tools_out_and_reads_no_calls(client, tokenizer):
    r = ask(client, "<ask_weather>", tool_choice="none")
    assert choice_of(r).message.content.startswith("Let me check.\n<tool_call>") and not choice_of(r).message.tool_calls
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi <ask_weather>"}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    assert r.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),  # one constraint
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [TOOLS[0]["function"]]}, "functions"),
    ({"response_format": {"type": "xml"}}, "response_format"),  # json_schema / json_object: test_api_structured
    ({"logprobs": "yes"}, "logprobs"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"store": True}, "store"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"top_k": 5}, "top_k"),  # not an OpenAI field: refused like OpenAI's "Unrecognized request argument"
    ({"max_token": 5}, "max_token"),  # a typo is not silently ignored
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {  # issue 39
        "type": "object", "properties": {"a": {"type": "string", "pattern": "^a{1000000}$"}}}}}]}, "tools"),
])
def test_what_is_not_honoured_is_a_400_naming_the_field(client, fields, param):
    body = {"tools": TOOLS, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi <ask_weather>"}],
                                       extra_body=body)
    assert e.value.body["param"] == param and e.value.body["message"]


def test_inert_values_are_served(client):
    r = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi <sunny>"}],
                                       extra_body={"user": "u1", "logprobs": False, "frequency_penalty": 0,
                                                   "response_format": {"type": "text"}, "stream_options": None})
    assert choice_of(r).message.content == "It is sunny in Paris."


# --- the parser alone (no server) -------------------------------------------------------------------------

def parse(text: str, cuts: list[int], names: frozenset) -> list:
    """`text` fed in pieces cut at `cuts`; items merged so that two feedings compare equal."""
    parser, items = CallParser(names=names), []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        items += parser.feed(text[a:b])
    items += parser.finish()
    merged = []
    for kind, item in items:
        if kind == "content" and merged and merged[-1][0] == "content":
            merged[-1] = ("content", merged[-1][1] + item)
        else:
            merged.append((kind, item if kind == "content" else (item.name, item.arguments)))
    return merged


PIECES = st.sampled_from(["<tool_call>", "</tool_call>", "<tool", "_call>", "<", '{"name": "f", "arguments": {"a": 1}}',
                          '{"name": 3}', "{", "x", " ", "\n", "é", "```json\n", "```", "`"])


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(PIECES, max_size=12), names=st.sampled_from([frozenset(), frozenset({"f"})]), data=st.data())
def test_the_parser_reads_the_same_however_the_text_is_cut(pieces, names, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=6)))
    items = parse(text, [], names)
    assert parse(text, cuts, names) == items
    if not any(kind == "call" for kind, _ in items):  # no call: the answer's text, but a call cut off at its end
        assert "".join(item for _, item in items) == without_a_cut_off_call(text)


def without_a_cut_off_call(text: str) -> str:
    """An answer's text less a <tool_call> with no </tool_call> after it (max_tokens cut it) and the whitespace
    before that: what the parser gives back of an answer without calls."""
    end = 0
    while (start := text.find("<tool_call>", end)) >= 0:
        end = text.find("</tool_call>", start + len("<tool_call>"))
        if end < 0:
            return text[:start].rstrip()
        end += len("</tool_call>")
    return text


@pytest.mark.parametrize("tags_are_tokens", [True, False])
def test_the_call_grammar_takes_a_call_of_the_named_tool_and_nothing_else(tmp_path, tags_are_tokens):
    """What tool_choice required / named will hand to the grammar: the tags as one token each (Qwen) or as text."""
    import llguidance
    import llguidance.hf

    from launch.serve.tools import call_grammar
    save_tiny_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    if tags_are_tokens:
        tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in ("<tool_call>", "</tool_call>")])
    wrapped = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id])

    def takes(text: str, **choice) -> bool:
        matcher = llguidance.LLMatcher(wrapped, llguidance.grammar_from("lark", call_grammar(TOOLS, tokenizer, **choice)),
                                       log_level=0)
        return matcher.consume_tokens(tokenizer(text)["input_ids"]) and matcher.is_accepting()
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert takes(call) and takes(other) and takes(f"{call}\n{other}")
    assert takes(call, name="get_weather") and not takes(other, name="get_weather")
    assert not takes(f"{call}\n{other}", parallel=False)
    assert not takes("Sure: " + call) and not takes(call.replace("Paris", "7").replace('"7"', "7"))


def test_a_fenced_call_cut_anywhere_is_the_same_call():
    text = ' ```json\n{"name": "f", "arguments": {"a": 1}}\n```'
    for cut in range(len(text) + 1):
        assert parse(text, [cut], frozenset({"f"})) == [("call", ("f", '{"a": 1}'))], cut


# --- the same tools on the Responses API ------------------------------------------------------------------

RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def items_of(output) -> list[tuple]:
    return [("message", o.content[0].text) if o.type == "message" else (o.type, o.name, json.loads(o.arguments))
            for o in output]


def test_responses_read_calls_as_function_call_items_streamed_and_not(client):
    r = client.responses.create(model="scripted", input="hi <ask_weather>", tools=RESPONSES_TOOLS)
    assert items_of(r.output) == [("message", "Let me check."), ("function_call", "get_weather", {"city": "Paris", "unit": "°C"})]
    chat = choice_of(ask(client, "<ask_weather>"))
    assert r.output[1].arguments == chat.message.tool_calls[0].function.arguments and r.status == "completed"
    assert r.output[1].call_id.startswith("call_") and r.output[1].status == "completed"
    events = list(client.responses.create(model="scripted", input="hi <ask_weather>", tools=RESPONSES_TOOLS, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert items_of(done) == items_of(r.output) == items_of(events[-1].response.output)
    arguments = [e for e in events if e.type.startswith("response.function_call_arguments")]
    assert "".join(e.delta for e in arguments if e.type.endswith("delta")) == arguments[-1].arguments == r.output[1].arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_function_call_outputs_reach_the_template(client, model, tokenizer):
    r = client.responses.create(model="scripted", tools=RESPONSES_TOOLS, input=[
        {"role": "user", "content": "hi <ask_weather>"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "22 °C <sunny>"}])
    assert items_of(r.output) == [("message", "It is sunny in Paris.")]
    chat = client.chat.completions.create(model="scripted", tools=TOOLS, messages=[
        {"role": "user", "content": "hi <ask_weather>"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 °C <sunny>"}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.tandem["token_ids"] == chat.tandem["token_ids"]


@pytest.mark.parametrize("fields,param", [({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
                                          ({"tools": [{"type": "web_search"}]}, "tools")])
def test_responses_tool_fields_not_honoured_are_400s(client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="scripted", input="hi <ask_weather>", extra_body={"tools": RESPONSES_TOOLS, **fields})
    assert e.value.body["param"] == param


FORCED_TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"], "additionalProperties": False}}}
    for name in ("set_unit", "get_unit")]


@pytest.fixture(scope="module")
def long_client(model):
    """The scripted model with room for a whole call in the tiny tokenizer's short tokens."""
    args = served_args(model, model, "model.max_len=1024", "draft.max_len=1024", "gen.max_new_tokens=200", "spec.k=2")
    with served(*args) as s:
        yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("choice,name", [("required", None), ({"type": "function", "function": {"name": "get_unit"}}, "get_unit")])
def test_tool_choice_required_or_named_makes_the_answer_a_call(long_client, choice, name):
    """The scripted model would answer in text ("It is sunny in Paris."); tool_choice required / named holds the
    answer to a call, enforced by the grammar where the target verifies: it parses, names an offered tool (the
    named one when named) and its arguments fit the tool's parameters."""
    for stream in (False, True):
        kwargs = dict(model="scripted", messages=[{"role": "user", "content": "hi <sunny>"}], tools=FORCED_TOOLS,
                      tool_choice=choice, parallel_tool_calls=False)
        if not stream:
            r = long_client.chat.completions.create(**kwargs)
            calls, finish = r.choices[0].message.tool_calls or [], r.choices[0].finish_reason
            got = [(c.function.name, c.function.arguments) for c in calls]
        else:
            parts, finish = {}, None
            for chunk in long_client.chat.completions.create(**kwargs, stream=True):
                for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                    entry = parts.setdefault(d.index, ["", ""])
                    entry[0] += d.function.name or ""
                    entry[1] += d.function.arguments or ""
                finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
            got = [tuple(v) for _, v in sorted(parts.items())]
        assert finish == "tool_calls" and len(got) == 1, (stream, finish, got)
        assert got[0][0] == (name or got[0][0]) and got[0][0] in ("set_unit", "get_unit")
        assert json.loads(got[0][1]) in ({"unit": "c"}, {"unit": "f"})
    r = long_client.responses.create(model="scripted", input="hi <sunny>", tool_choice="required",
                                     tools=[{"type": "function", **t["function"]} for t in FORCED_TOOLS])
    assert [item.type for item in r.output] == ["function_call"] and json.loads(r.output[0].arguments)["unit"] in "cf"



# --- issue 39 (6): a forced call, and what comes after it -------------------------------------------------------

def tag_tokenizer(folder: Path):
    """The tiny tokenizer with <tool_call> and </tool_call> as one token each (as Qwen's)."""
    save_tiny_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in ("<tool_call>", "</tool_call>")])
    return tokenizer


@pytest.mark.parametrize("parallel", [True, False])
def test_a_forced_call_is_written_as_the_template_writes_it_then_another_call_or_the_end(tmp_path, parallel):
    """At every position of a call of get_unit, each token the grammar allows continues `{"name": "get_unit",
    "arguments": {"unit": "c"}}` or its "f" twin (no whitespace of the model's choosing: a model cannot pad a call
    to max_tokens); after the call only the end, or with parallel calls a newline and then only another call."""
    from speculative.grammar import Grammars, lark_source
    tokenizer = tag_tokenizer(tmp_path)
    eos, newline, open_tag = tokenizer.eos_token_id, *tokenizer("\n<tool_call>", add_special_tokens=False)["input_ids"]
    grammar = Grammars(tokenizer, len(tokenizer), [eos]).from_source(
        lark_source(call_grammar(FORCED_TOOLS, tokenizer, "get_unit", parallel)))
    calls = [f'<tool_call>\n{{"name": "get_unit", "arguments": {{"unit": "{unit}"}}}}\n</tool_call>' for unit in "cf"]
    written = ""
    for token in tokenizer(calls[0], add_special_tokens=False)["input_ids"]:
        for allowed in grammar.allowed().nonzero().flatten().tolist():
            piece = tokenizer.decode([allowed])
            assert any(call.startswith(written + piece) for call in calls), (written, piece)
        grammar.accept(token)
        written += tokenizer.decode([token])
    assert written == calls[0]
    assert set(grammar.allowed().nonzero().flatten().tolist()) == ({eos, newline} if parallel else {eos})
    if parallel:
        grammar.accept(newline)
        assert grammar.allowed().nonzero().flatten().tolist() == [open_tag]


CALL = '<tool_call>\n{"name": "get_unit", "arguments": {"unit": "c"}}\n</tool_call>'


@pytest.mark.parametrize("forced", [True, False])
def test_a_call_cut_off_at_the_end_is_never_content(forced):
    """max_tokens stopped the answer inside its second call: the first is the call, nothing of the second is
    content (forced or auto), however the text came; the finish reason is length, not tool_calls."""
    text = f'{CALL}\n<tool_call>\n{{"name": "set_u'
    for cut in range(len(text) + 1):
        parser = CallParser(names=frozenset({"get_unit", "set_unit"}), forced=forced)
        items = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()
        assert [(kind, item.name if kind == "call" else item) for kind, item in items] == [("call", "get_unit")], cut
    assert finish_reason(parser, "length") == "length"
    assert finish_reason(parser, "stop") == "tool_calls"
    assert finish_reason(CallParser(), "stop") == "stop" and finish_reason(None, "length") == "length"


def test_a_forced_answer_gives_no_content_even_when_not_a_call():
    """tool_choice required / named (ToolSetup.parser): the grammar leaves no text besides calls, and what a cut
    leaves (the start of a tag) is not content either."""
    parser = ToolSetup(FORCED_TOOLS, True, forced="*").parser()
    items = parser.feed(f"{CALL}\n<tool_") + parser.finish()
    assert [kind for kind, _ in items] == ["call"]


def test_a_forced_call_cut_by_max_tokens_is_length_with_no_content(long_client):
    """tool_choice required with parallel_tool_calls left at its default, and max_tokens too small for the call:
    finish_reason length, and no part of the call in content, streamed or not."""
    kwargs = dict(model="scripted", messages=[{"role": "user", "content": "hi <sunny>"}], tools=FORCED_TOOLS,
                  tool_choice="required", max_tokens=20)
    r = long_client.chat.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 20
    assert not r.choices[0].message.content and not r.choices[0].message.tool_calls
    chunks = list(long_client.chat.completions.create(**kwargs, stream=True))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
