"""``LLM.chat`` renders conversations as vLLM's: its own template, tools, documents, template
variables, continuing the last turn; a template's own error is a ``ValueError`` with its message."""

from __future__ import annotations

import pytest
from PIL import Image

from raypaged import LLM, SamplingParams
from raypaged.sampling_params import BeamSearchParams
from tests.serving.conftest import tiny_model_dir  # noqa: F401  (session fixture)

ONE = SamplingParams(temperature=0, max_tokens=1)
SHOW = (
    "{% for m in messages %}[{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments.city }}>{% endfor %}{% endfor %}"
    "{% for t in tools or [] %}(tool {{ t.function.name }}){% endfor %}"
    "{% for d in documents or [] %}(doc {{ d.title }}){% endfor %}"
    "{% if greeting %}{{ greeting }}{% endif %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), num_gpu_blocks_override=64, max_model_len=256)


def _prompt(llm: LLM, messages: list[dict], **kwargs) -> str:
    return llm.chat(messages, ONE, use_tqdm=False, **kwargs)[0].prompt


def test_the_models_template_by_default(llm):
    text = _prompt(llm, [{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_of_the_call_gets_names_tool_calls_tools_documents_and_variables(llm):
    messages = [
        {"role": "user", "name": "ann", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
            ],
        },
    ]
    text = _prompt(
        llm,
        messages,
        chat_template=SHOW,
        tools=[{"type": "function", "function": {"name": "get_weather"}}],
        documents=[{"title": "faq", "text": "..."}],
        chat_template_kwargs={"greeting": "hello"},
    )
    assert text == "[user:ann]weather?[assistant]<get_weather Oslo>(tool get_weather)(doc faq)hello[assistant]"


def test_continue_final_message_extends_the_last_turn(llm):
    messages = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "1, 2,"}]
    text = _prompt(llm, messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\n1, 2,")


PARTS = (
    "{% for m in messages %}[{{ m.role }}]{% for p in m['content'] %}({{ p.type }}:{{ p.text }}){% endfor %}"
    "{% endfor %}"
)


def test_content_reaches_the_template_as_its_format_asks_and_auto_reads_the_template(llm):
    """vLLM's content formats: a template that loops over a message's parts gets parts under auto (and openai);
    string gives it one string (its text parts joined), which such a template reads as characters."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"},
        {"role": "assistant", "content": None},
    ]
    parts = "[user](text:a)(text:b)[assistant](text:c)[assistant]"
    assert _prompt(llm, messages, chat_template=PARTS, add_generation_prompt=False) == parts
    openai = _prompt(
        llm, messages, chat_template=PARTS, add_generation_prompt=False, chat_template_content_format="openai"
    )
    assert openai == parts
    joined = _prompt(
        llm, messages, chat_template=SHOW, add_generation_prompt=False, chat_template_content_format="auto"
    )
    assert joined == "[user]a\nb[assistant]c[assistant]"  # SHOW reads content whole: one string, parts joined
    as_string = _prompt(
        llm, messages, chat_template=PARTS, add_generation_prompt=False, chat_template_content_format="string"
    )
    assert as_string == "[user](:)(:)(:)[assistant](:)[assistant]"  # "a\nb" and "c", character by character


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"chat_template": "{{ raise_exception('roles must alternate') }}"},
            "the chat template failed: TemplateError: roles must alternate",
        ),
        ({"continue_final_message": True}, "continue_final_message and add_generation_prompt cannot both be true"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs may not set 'tools'"),
        (
            {"chat_template_content_format": "parts"},
            "chat_template_content_format 'parts' is not one of auto, string, openai",
        ),
    ],
)
def test_what_cannot_render_is_a_value_error_naming_it(llm, kwargs, message):
    with pytest.raises(ValueError, match="^" + message + "$"):
        llm.chat([{"role": "user", "content": "hi"}], ONE, use_tqdm=False, **kwargs)
    assert not llm.llm_engine.has_unfinished_requests()


def test_reset_prefix_cache_makes_the_next_prompt_compute_again(llm):
    prompt = {"prompt_token_ids": list(range(100, 180))}
    llm.generate(prompt, ONE, use_tqdm=False)
    hits = llm.stats()["prefix_cache_hits"]
    llm.generate(prompt, ONE, use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] > hits
    assert llm.reset_prefix_cache() is True
    hits = llm.stats()["prefix_cache_hits"]
    llm.generate(prompt, ONE, use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] == hits


def test_a_prompts_cache_salt_keeps_its_prefix_blocks_to_its_own_salt(llm):
    ids = list(range(300, 380))  # five full blocks of 16

    def cached(**salt) -> int:
        [output] = llm.generate({"prompt_token_ids": ids, **salt}, ONE, use_tqdm=False)
        return output.num_cached_tokens

    assert llm.reset_prefix_cache() is True
    assert [cached(cache_salt="x"), cached(cache_salt="x"), cached(cache_salt="y"), cached()] == [0, 64, 0, 0]
    assert llm.reset_prefix_cache() is True
    beams = llm.beam_search(
        [{"prompt_token_ids": ids, "cache_salt": "z"}], BeamSearchParams(beam_width=2, max_tokens=2)
    )
    assert len(beams[0].sequences) == 2
    assert [cached(), cached(cache_salt="z")] == [0, 64]  # the beam search left its blocks under its salt only
    with pytest.raises(ValueError, match=r"reads text only \(no images\)$"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": Image.new("RGB", (4, 4))}}, ONE, use_tqdm=False)
    with pytest.raises(ValueError, match="a prompt's cache_salt must be a non-empty string, got ''"):
        llm.generate({"prompt": "hi", "cache_salt": ""}, ONE, use_tqdm=False)
