"""Issue 30: POST /v1/responses through the real `openai` client (client.responses.create) against the real server
in process, behind an API key: the same greedy request gives the same text as /v1/chat/completions (and as
transformers generate), streamed and not; what it does not honour is a 400 naming the field."""
import openai
import pytest
from transformers import AutoTokenizer

from tests.support.serve_harness import chat_folder, served, served_args
from tests.support.tiny_models import reference_greedy, with_eos

KEY = "responses-test-key"
INSTRUCTIONS = "Answer in code."
QUESTION = "def reverse(s):"
EOS_AT = 5  # the answer to QUESTION ends with its 6th token: that token is the served model's end of sequence


def chat_ids(tokenizer, messages):
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


CONVERSATION = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target with an end-of-sequence token that its answer to QUESTION reaches (so both a completed and an
    incomplete response can be asked for)."""
    root = tmp_path_factory.mktemp("responses")
    plain, draft = chat_folder(root / "plain", seed=1), chat_folder(root / "draft", seed=7, layers=2)
    answer = reference_greedy(plain, chat_ids(AutoTokenizer.from_pretrained(plain), CONVERSATION), 16)
    assert answer[EOS_AT] not in answer[:EOS_AT]
    return with_eos(plain, root / "target", answer[EOS_AT]), draft, answer[EOS_AT]


@pytest.fixture(scope="module")
def server(models):
    with served(*served_args(*models[:2], f"serve.api_key={KEY}")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(models):
    return AutoTokenizer.from_pretrained(models[0])


@pytest.mark.parametrize("max_tokens,status", [(16, "completed"), (3, "incomplete")])
def test_the_response_text_equals_the_chat_text(client, models, tokenizer, max_tokens, status):
    chat = client.chat.completions.create(model="target", messages=CONVERSATION, max_tokens=max_tokens)
    r = client.responses.create(model="target", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=max_tokens)
    assert r.output_text == chat.choices[0].message.content and r.output_text
    expected = reference_greedy(models[0], chat_ids(tokenizer, CONVERSATION), max_tokens, eos=models[2])
    assert r.tandem["token_ids"] == chat.tandem["token_ids"] == expected
    assert r.status == status and r.output[0].status == status
    assert (r.incomplete_details.reason if r.incomplete_details else None) == \
        ("max_output_tokens" if status == "incomplete" else None)
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == len(expected)
    assert r.id.startswith("resp_") and r.output[0].role == "assistant"


@pytest.mark.parametrize("max_tokens,last", [(16, "response.completed"), (3, "response.incomplete")])
def test_the_streamed_response_is_the_same_text_in_typed_events(client, max_tokens, last):
    whole = client.responses.create(model="target", instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=max_tokens)
    events = list(client.responses.create(model="target", instructions=INSTRUCTIONS, input=QUESTION,
                                          max_output_tokens=max_tokens, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", last]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == whole.output_text  # as rounds commit, not at the end
    assert events[-4].text == whole.output_text and events[-1].response.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_message_list_input_equals_the_chat_conversation(client):
    messages = [{"role": "user", "content": "naïve café"}, {"role": "assistant", "content": "print('ok')"},
                {"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model="target", messages=[{"role": "system", "content": INSTRUCTIONS}, *messages],
                                          max_tokens=8)
    r = client.responses.create(model="target", max_output_tokens=8, input=[
        {"role": "developer", "content": [{"type": "input_text", "text": INSTRUCTIONS}]},
        messages[0], {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "print('ok')"}]},
        messages[2]])
    assert r.tandem["token_ids"] == chat.tandem["token_ids"] and r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_the_api_key_is_checked(server):
    anonymous = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        anonymous.responses.create(model="target", input=QUESTION, max_output_tokens=2)


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}}, "text"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"seed": 3}, "seed"),  # not a Responses API field
    ({"max_output_tokens": 33}, "max_output_tokens"),  # > gen.max_new_tokens
    ({"temperature": 3}, "temperature"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),  # no call_id
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": ""}, "input"),
    ({"instructions": ["x"]}, "instructions"),
])
def test_what_is_not_honoured_is_a_400_naming_the_field(client, fields, param):
    body = {"input": QUESTION, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="target", extra_body=body)
    assert e.value.body["param"] == param and e.value.body["message"]


def test_inert_values_are_served(client):
    r = client.responses.create(model="target", input=QUESTION, max_output_tokens=2, store=False, user="u1",
                                metadata={"a": "b"}, text={"format": {"type": "text"}}, tool_choice="auto", tools=[])
    assert r.usage.output_tokens == 2
