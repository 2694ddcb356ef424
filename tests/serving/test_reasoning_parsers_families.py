"""vLLM's reasoning parsers for the model families served (glm45, deepseek_v3, ernie45, granite, mistral, seed_oss,
minimax_m2, minimax_m2_append_think): whole and streamed splits, where constraints start, what a thinking budget
forces, which markers are special tokens, and DeepSeek-V3.1's thinking decided per request on a real server."""

from __future__ import annotations

import json

import pytest

from raypaged.serving.gateway.reasoning import PARSERS, get_reasoning_parser
from raypaged.structured.reasoning import ReasoningConfig, closed_in
from tests.serving.conftest import (
    Stack,
    after_section_ends,
    serving,
    streamed_parts,  # noqa: F401  (tiny_model_dir: a session fixture)
    tiny_config,
)

WHOLE = [
    # GLM-4.5/4.6 write <think> themselves: only an output that opens with it has a section
    ("glm45", "<think>plan it</think>The answer.", ("plan it", "The answer.")),
    ("glm45", "\n<think>\nplan it</think>\nThe answer.", ("\nplan it", "\nThe answer.")),
    ("glm45", "The answer.", (None, "The answer.")),
    ("glm45", "<think></think>The answer.", ("", "The answer.")),
    ("glm45", "<think>cut off", ("cut off", None)),
    # DeepSeek-V3.1 without its request's thinking: no reasoning at all
    ("deepseek_v3", "plan it</think>The answer.", (None, "plan it</think>The answer.")),
    # ERNIE-4.5 thinking: the template opens the section; the answer may be wrapped in <response>
    ("ernie45", "plan it\n</think>\n\n<response>\nThe answer.\n</response>\n", ("plan it\n", "\nThe answer.\n")),
    ("ernie45", "plan it\n</think>\nThe answer.", ("plan it\n", "\nThe answer.")),
    ("ernie45", "<think>plan it</think><response>a</response>b</response>\n", ("plan it", "a</response>b")),
    ("ernie45", "plan it</think>\n\n<response>\ncut off", ("plan it", "\ncut off")),
    ("ernie45", "still thinking", ("still thinking", None)),
    # IBM Granite 3.x: plain-text markers, "Here is" or "Here's"
    (
        "granite",
        "Here is my thought process:\nplan it\nHere is my response:\nThe answer.",
        ("\nplan it\n", "\nThe answer."),
    ),
    ("granite", "Here's my thought process: plan it Here's my response: The answer.", (" plan it ", " The answer.")),
    ("granite", "The answer. Here is my response: more", (None, "The answer. Here is my response: more")),
    ("granite", "Here is my thought process: cut off", (" cut off", None)),
    # Magistral: the first [THINK] section wherever it opens, the text around it content
    ("mistral", "[THINK]plan it[/THINK]The answer.", ("plan it", "The answer.")),
    ("mistral", "\n[THINK]plan it[/THINK]\nThe answer.", ("plan it", "\n\nThe answer.")),
    ("mistral", "So: [THINK]plan it[/THINK] fine.", ("plan it", "So:  fine.")),
    ("mistral", "plan it[/THINK]The answer.", (None, "plan itThe answer.")),  # an end before any start: dropped
    ("mistral", "[THINK]cut off", ("cut off", None)),
    ("mistral", "The answer.", (None, "The answer.")),
    # Seed-OSS: as R1, with its own markers
    ("seed_oss", "<seed:think>plan it</seed:think>The answer.", ("plan it", "The answer.")),
    ("seed_oss", "plan it</seed:think>The answer.", ("plan it", "The answer.")),
    ("seed_oss", "still thinking", ("still thinking", None)),
    # MiniMax-M2: the template opens <think>
    ("minimax_m2", "plan it</think>The answer.", ("plan it", "The answer.")),
    ("minimax_m2", "plan it</think>", ("plan it", None)),
    ("minimax_m2", "still thinking", ("still thinking", None)),
    ("minimax_m2_append_think", "plan it</think>The answer.", (None, "<think>plan it</think>The answer.")),
    ("minimax_m2_append_think", "", (None, "<think>")),
]


@pytest.mark.parametrize(("name", "output", "expected"), WHOLE)
def test_split_whole(name, output, expected):
    assert get_reasoning_parser(name).split(output) == expected


@pytest.mark.parametrize(("name", "output", "expected"), WHOLE)
@pytest.mark.parametrize("piece", [1, 2, 3, 7])
def test_streamed_in_pieces_gives_the_same_parts(name, output, expected, piece):
    assert streamed_parts(name, output, piece) == (expected[0] or "", expected[1] or "")


def _deltas(name: str, pieces: list[str]) -> list[tuple[str, str]]:
    stream = get_reasoning_parser(name).stream()
    return [stream.feed(piece) for piece in pieces] + [stream.finish()]


def test_a_marker_split_across_deltas_is_held_back_until_whole():
    assert _deltas("mistral", ["So [TH", "INK]pl", "an[/TH", "INK]ok"]) == [
        ("", "So "),
        ("pl", ""),
        ("an", ""),
        ("", "ok"),
        ("", ""),
    ]
    assert _deltas("granite", ["Here is my thought", " process: plan Here is my re", "sponse: ok"]) == [
        ("", ""),  # it could still open the section
        (" plan ", ""),
        ("", " ok"),
        ("", ""),
    ]
    assert _deltas("seed_oss", ["<seed:", "think>plan</seed", ":think>ok"]) == [
        ("", ""),
        ("plan", ""),
        ("", "ok"),
        ("", ""),
    ]


def test_ernie_holds_the_answer_back_until_it_shows_its_wrapper():
    assert _deltas("ernie45", ["plan</think>\n", "\n<resp", "onse>\nok\n</resp", "onse>\n"]) == [
        ("plan", ""),
        ("", ""),
        ("", "\nok\n"),
        ("", ""),
        ("", ""),  # the last </response> and what follows it are dropped
    ]
    assert _deltas("ernie45", ["plan</think>\n", "ok"]) == [("plan", ""), ("", "\nok"), ("", "")]
    # a </response> that another follows was text of the answer
    assert _deltas("ernie45", ["plan</think><response>a</response>b", "</response>"]) == [
        ("plan", "a"),
        ("", "</response>b"),
        ("", ""),
    ]


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({}, (None, "plan</think>ok")),
        ({"thinking": True}, ("plan", "ok")),
        ({"enable_thinking": True}, ("plan", "ok")),
        ({"thinking": False, "enable_thinking": False}, (None, "plan</think>ok")),
        ({"thinking": True, "enable_thinking": False}, ("plan", "ok")),  # either one turns it on, as vLLM
        ({"reasoning_effort": "high"}, (None, "plan</think>ok")),  # the effort alone is no switch
    ],
)
def test_deepseek_v3_thinks_when_the_requests_template_variables_turn_thinking_on(variables, expected):
    parser = get_reasoning_parser("deepseek_v3").for_template(variables)
    assert parser.split("plan</think>ok") == expected
    assert parser.thinking is (expected[0] is not None)


def test_the_other_formats_do_not_depend_on_the_request():
    for name, parser in PARSERS.items():
        if name != "deepseek_v3":
            assert parser.for_template({"thinking": False, "enable_thinking": False}) is parser


def test_which_markers_are_special_tokens():
    assert sorted(n for n, p in PARSERS.items() if p.special_tokens) == ["mistral", "openai_gptoss"]


@pytest.mark.parametrize(
    ("name", "delimiters"),
    [
        ("glm45", ("<think>", "</think>")),
        ("deepseek_v3", ("<think>", "</think>")),
        ("ernie45", ("<think>", "</think>")),
        ("granite", ("Here is my thought process:", "Here is my response:")),
        ("mistral", ("[THINK]", "[/THINK]")),
        ("seed_oss", ("<seed:think>", "</seed:think>")),
        ("minimax_m2", ("<think>", "</think>")),
        ("minimax_m2_append_think", ("<think>", "</think>")),
    ],
)
def test_a_thinking_budget_counts_from_the_start_and_forces_the_end(name, delimiters):
    assert ReasoningConfig().delimiters(name) == delimiters


def test_a_prompt_that_closed_the_section_leaves_no_reasoning_to_wait_for():
    assert closed_in("<|assistant|>\n<think></think>", get_reasoning_parser("glm45").end)  # GLM without thinking
    assert closed_in("<｜Assistant｜></think>", get_reasoning_parser("deepseek_v3").end)  # V3.1 without thinking
    assert not closed_in("<｜Assistant｜><think>", get_reasoning_parser("deepseek_v3").end)
    assert not closed_in("[INST]Hi[/INST]", get_reasoning_parser("mistral").end)


ANSWER = '{"ok": true}'


@pytest.mark.parametrize(
    ("name", "reasoned", "answer_alone"),
    [
        ("glm45", "<think>plan</think>\n", True),
        ("granite", "Here is my thought process: plan Here is my response: ", True),
        ("mistral", "[THINK]plan[/THINK]", True),
        ("seed_oss", "plan</seed:think>\n", False),
        ("ernie45", "plan\n</think>\n\n", False),
        ("minimax_m2", "plan</think>", False),
        ("deepseek_v3", "plan</think>", False),
    ],
)
def test_a_constraint_applies_after_the_section(smollm2_dir, name, reasoned, answer_alone):
    ends = after_section_ends(smollm2_dir, name)

    assert ends(reasoned + ANSWER) is True
    assert ends(reasoned + "Hello") is None
    # a format whose section is optional may answer at once; one the template opens reads it as reasoning
    assert ends(ANSWER) is answer_alone


# the tiny model's output made a DeepSeek-V3.1 answer by a constraint on "tiny", whose engine knows no reasoning
# parser (the constraint applies from the first token); "tiny-r"'s constraints follow deepseek_v3's section
FORCED = "plan it</think>The answer."
THOUGHT = {"role": "assistant", "reasoning_content": "plan it", "content": "The answer."}
PLAIN = {"role": "assistant", "reasoning_content": None, "content": FORCED}


@pytest.fixture(scope="module")
def http(tiny_model_dir):
    yield from serving(
        [
            tiny_config(tiny_model_dir, "tiny"),
            tiny_config(tiny_model_dir, "tiny-r", structured_outputs_config={"reasoning_parser": "deepseek_v3"}),
        ],
        reasoning_parser="deepseek_v3",
        enable_scale_out=True,
    )


def _chat(model: str = "tiny", **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0}
    if model == "tiny":
        body["structured_outputs"] = {"choice": [FORCED]}
    return body | extra


def _streamed(http, body: dict) -> dict:
    text = http.post("/v1/chat/completions", json={**body, "stream": True}).text
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in text.splitlines() if line.startswith("data: {")]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    return {
        "role": "assistant",
        "reasoning_content": reasoning or None,
        "content": "".join(d.get("content") or "" for d in deltas),
    }


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, PLAIN),
        ({"chat_template_kwargs": {"thinking": True}}, THOUGHT),
        ({"chat_template_kwargs": {"enable_thinking": True}}, THOUGHT),
        ({"reasoning_effort": "low"}, THOUGHT),  # the effort sets enable_thinking, as vLLM
        ({"reasoning_effort": "none"}, PLAIN),
        ({"reasoning_effort": "none", "chat_template_kwargs": {"thinking": True}}, THOUGHT),
    ],
)
def test_a_deepseek_v3_server_splits_the_reasoning_only_when_the_request_turns_thinking_on(http, extra, expected):
    whole = http.post("/v1/chat/completions", json=_chat(**extra)).json()["choices"][0]["message"]
    assert whole == expected
    assert _streamed(http, _chat(**extra)) == expected


def test_a_deepseek_v3_constraint_waits_for_the_section_only_when_the_request_thinks(http):
    json_object = {"response_format": {"type": "json_object"}, "max_tokens": 8}
    thinking = {"chat_template_kwargs": {"thinking": True}}
    free = http.post("/v1/chat/completions", json=_chat("tiny-r", **thinking, max_tokens=8)).json()
    waited = http.post("/v1/chat/completions", json=_chat("tiny-r", **thinking, **json_object)).json()
    at_once = http.post("/v1/chat/completions", json=_chat("tiny-r", **json_object)).json()
    unreasoned = http.post("/v1/chat/completions", json=_chat("tiny-r", **json_object, include_reasoning=False)).json()
    # thinking: the constraint waits for </think>, which this random model never writes: all is reasoning
    assert waited["choices"][0]["message"]["reasoning_content"] == free["choices"][0]["message"]["reasoning_content"]
    assert waited["choices"][0]["message"]["content"] is None
    # no thinking: the constraint applies from the first token, as with include_reasoning false
    message = at_once["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"].startswith("{")
    assert message["content"] == unreasoned["choices"][0]["message"]["content"]


@pytest.mark.parametrize(("extra", "expected"), [({}, PLAIN), ({"chat_template_kwargs": {"thinking": True}}, THOUGHT)])
def test_a_derendered_deepseek_v3_answer_thinks_as_its_rendered_request_says(http, extra, expected):
    """Output mode derender parses the answer as the chat route would: its parse_context's template variables say
    whether it thinks."""
    rendered = http.post("/v1/chat/completions/render", json=_chat(**extra)).json()
    answer = http.post("/inference/v1/generate", json={**rendered, "output_mode": "derender"}).json()
    message = answer["choices"][0]["message"]
    assert {k: message.get(k) for k in expected} == expected


def test_the_servers_default_template_variables_turn_deepseek_v3_thinking_on(tiny_model_dir):
    """``serve``'s --default-chat-template-kwargs '{"thinking": true}' reaches both the template and the parser: a
    request that says nothing thinks, one that turns thinking off does not."""
    defaults = {"thinking": True}
    stack = Stack(
        [tiny_config(tiny_model_dir, "tiny", default_chat_template_kwargs=defaults)],
        reasoning_parser="deepseek_v3",
        default_chat_template_kwargs=defaults,
        enable_scale_out=True,
    )
    try:
        with stack.client() as http:
            message = http.post("/v1/chat/completions", json=_chat()).json()["choices"][0]["message"]
            assert {k: message.get(k) for k in THOUGHT} == THOUGHT
            off = _chat(chat_template_kwargs={"thinking": False})
            message = http.post("/v1/chat/completions", json=off).json()["choices"][0]["message"]
            assert {k: message.get(k) for k in PLAIN} == PLAIN
            rendered = http.post("/v1/chat/completions/render", json=_chat()).json()  # derendered alike
            answer = http.post("/inference/v1/generate", json={**rendered, "output_mode": "derender"}).json()
            message = answer["choices"][0]["message"]
            assert {k: message.get(k) for k in THOUGHT} == THOUGHT
    finally:
        stack.close()
