"""OpenAI's Responses API (``/v1/responses``) through the official client, against SmolLM2 behind the gateway: the
same answers as chat completions, stored responses per tenant, the stream's events, function tools, structured
text, and the fields refused by name."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.serving.conftest import Stack
from tests.serving.test_tools_openai import WEATHER, hermes_smollm2

pytestmark = pytest.mark.slow
TENANTS = """
tenants:
  - name: a
    api_keys: [sk-a]
  - name: b
    api_keys: [sk-b]
"""
QUESTION = "What is the capital of France?"
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}


@pytest.fixture(scope="module")
def stack(smollm2_dir, tmp_path_factory):
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    tenants.write_text(TENANTS)
    stack = Stack(
        [hermes_smollm2(smollm2_dir)],
        tenants_file=str(tenants),
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="sk-a")


def chat(client, messages, **options):
    return client.chat.completions.create(model="smollm2", messages=messages, temperature=0, **options)


def test_a_response_is_the_chat_completion_of_its_instructions_and_input(client):
    response = client.responses.create(
        model="smollm2", instructions="Answer in one sentence.", input=QUESTION, max_output_tokens=24, temperature=0
    )
    expected = chat(
        client,
        [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": QUESTION}],
        max_completion_tokens=24,
    )
    assert response.status == "completed" and response.id.startswith("resp_")
    assert response.output_text == expected.choices[0].message.content and "Paris" in response.output_text
    [message] = response.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.usage.output_tokens == expected.usage.completion_tokens
    assert response.usage.total_tokens == expected.usage.total_tokens
    assert (response.instructions, response.max_output_tokens, response.model) == (
        "Answer in one sentence.",
        24,
        "smollm2",
    )


def test_previous_response_id_continues_the_conversation_without_its_instructions(client):
    first = client.responses.create(
        model="smollm2", instructions="Be brief.", input=QUESTION, max_output_tokens=16, temperature=0
    )
    second = client.responses.create(
        model="smollm2",
        input="And of Germany?",
        previous_response_id=first.id,
        max_output_tokens=16,
        temperature=0,
    )
    expected = chat(
        client,
        [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And of Germany?"},
        ],
        max_completion_tokens=16,
    )
    assert second.previous_response_id == first.id
    assert second.output_text == expected.choices[0].message.content and "Berlin" in second.output_text


def test_stored_responses_are_read_and_deleted_by_their_tenant_only(stack, client):
    response = client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    [item] = client.responses.input_items.list(response.id).data
    assert (item.type, item.role, item.content[0].text) == ("message", "user", QUESTION)
    other = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="sk-b")
    for call in (lambda: other.responses.retrieve(response.id), lambda: other.responses.delete(response.id)):
        with pytest.raises(openai.NotFoundError, match="response with id 'resp_"):
            call()
    with pytest.raises(openai.BadRequestError) as refused:
        other.responses.create(model="smollm2", input="Go on", previous_response_id=response.id)
    assert refused.value.body["param"] == "previous_response_id"
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    unstored = client.responses.create(model="smollm2", input=QUESTION, max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_stream_is_the_responses_events_of_the_same_answer(client):
    story = "Write a short story about a cat."
    whole = client.responses.create(model="smollm2", input=story, max_output_tokens=12, temperature=0)
    events = list(
        client.responses.create(model="smollm2", input=story, max_output_tokens=12, temperature=0, stream=True)
    )
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # 12 tokens: the limit ends it
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text and deltas > 1
    assert final.status == whole.status == "incomplete"
    assert final.incomplete_details.reason == whole.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 12
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id


def test_function_tools_give_calls_and_take_their_outputs_back(client):
    response = client.responses.create(
        model="smollm2",
        input="What is the weather in Paris?",
        tools=[TOOL],
        tool_choice="required",
        max_output_tokens=80,
        temperature=0,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id.startswith("chatcmpl-tool-") for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    followed = client.responses.create(
        model="smollm2",
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            *[{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls],
            *[{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 21 C"} for c in calls],
        ],
        tools=[TOOL],
        tool_choice="none",
        max_output_tokens=30,
        temperature=0,
    )
    assert [item.type for item in followed.output] == ["message"] and followed.output_text


def test_streamed_function_calls_join_to_their_arguments(client):
    events = list(
        client.responses.create(
            model="smollm2",
            input="What is the weather in Paris?",
            tools=[TOOL],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=80,
            temperature=0,
            stream=True,
        )
    )
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    [call] = [item for item in events[-1].response.output if item.type == "function_call"]
    assert deltas == done.arguments == call.arguments and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_text_format_json_schema_constrains_the_answer(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}
    response = client.responses.create(
        model="smollm2",
        input="Name a city in JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
        max_output_tokens=60,
        temperature=0,
    )
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def test_output_text_logprobs_are_included_on_request(client):
    response = client.responses.create(
        model="smollm2",
        input=QUESTION,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        max_output_tokens=5,
        temperature=0,
    )
    part = response.output[0].content[0]
    assert len(part.logprobs) == 5 and "".join(p.token for p in part.logprobs) == part.text
    assert all(len(p.top_logprobs) == 2 and p.top_logprobs[0].token == p.token for p in part.logprobs)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"tools": [{"type": "web_search"}]}, "tools of type 'web_search' are not supported (function tools only)"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
            "the model smollm2 reads text only (no images)",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
            "input[0] input_image needs an image_url (a URL; got file_id)",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
            "input[0] content of type 'input_file' is not supported (text and input_image parts)",
        ),
        ({"background": True}, "background is not supported by this server; send the request without it"),
        ({"truncation": "auto"}, "truncation 'auto' is not supported (only disabled: a prompt too long is a 400)"),
        (
            {"reasoning": {"effort": "high", "summary": "auto"}},
            "reasoning.summary is not supported by this server (reasoning.effort is); send the request without it",
        ),
        (
            {"extra_body": {"thinking_token_budget": 4}},
            "thinking_token_budget needs to know where a reasoning section starts and ends: serve with "
            "--reasoning-parser or --reasoning-config",
        ),
        ({"extra_body": {"cache_salt": ""}}, "cache_salt: String should have at least 1 character"),
        (
            {"extra_body": {"logprob_token_ids": [5]}},
            "logprob_token_ids needs logprobs (a completion's count, or a chat's logprobs: true)",
        ),
        (
            {"reasoning": {"effort": "extreme"}},
            "reasoning_effort: Input should be 'none', 'minimal', 'low', 'medium', 'high', 'xhigh' or 'max'",
        ),
        (
            {"include": ["reasoning.encrypted_content"]},
            "include 'reasoning.encrypted_content' is not supported (only 'message.output_text.logprobs')",
        ),
        (
            {"input": [{"type": "item_reference", "id": "x"}]},
            "input[0] items of type 'item_reference' are not supported",
        ),
        (
            {"previous_response_id": "resp_unknown"},
            "response with id 'resp_unknown' not found (responses are kept in memory: the newest 4096 stored ones, "
            "up to 256 MiB of them)",
        ),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(client, options, message):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{"model": "smollm2", "input": QUESTION, "max_output_tokens": 4, **options})
    assert refused.value.body["message"] == message


def test_an_openai_agents_sdk_agent_runs_its_tool_loop(stack):
    """The OpenAI Agents SDK, unchanged but for its client's base_url, on its default Responses model: a function
    call, the tool's output sent back as a function_call_output item, then the answer; streamed and not."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        cities.append(city)
        return f"Sunny and 21 C in {city}"

    agent = Agent(
        name="weather",
        instructions="You answer weather questions. Call get_weather for the city.",
        tools=[get_weather],
        model=OpenAIResponsesModel(
            model="smollm2", openai_client=openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="sk-a")
        ),
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=60),
    )

    async def run() -> list:
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        streamed = Runner.run_streamed(agent, "What is the weather in Rome?", max_turns=4)
        kinds = [event.type async for event in streamed.stream_events()]
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
        return [result, streamed]

    for result in asyncio.run(run()):
        assert [type(item) for item in result.new_items] == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
        assert isinstance(result.final_output, str) and result.final_output
    assert len(cities) == 2 and all(cities)
