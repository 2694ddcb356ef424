"""vLLM's chat template content formats: what ``auto`` finds in a template, and each format's turns."""

from __future__ import annotations

import pytest

from raypaged.inputs.chat_format import resolve_content_format, with_content_format
from raypaged.multimodal import split_chat_images

LOOPS = [
    "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', 'text') %}x{% endfor %}{% endfor %}",
    "{% for m in messages %}{% set parts = m['content'] %}{% for p in parts %}{{ p.text }}{% endfor %}{% endfor %}",
]
READS_WHOLE = [
    "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% endif %}{% endfor %}",
    "{% for m in messages %}{% for t in tools %}{{ t }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",  # not parsed: string
]


@pytest.mark.parametrize("template", LOOPS)
def test_auto_is_openai_where_the_template_loops_over_a_messages_content(template):
    assert resolve_content_format("auto", template) == "openai"
    assert resolve_content_format("string", template) == "string"


@pytest.mark.parametrize("template", [*READS_WHOLE, None])
def test_auto_is_string_elsewhere(template):
    assert resolve_content_format("auto", template) == "string"
    assert resolve_content_format("openai", template) == "openai"


def test_each_format_shapes_every_turn_and_keeps_the_rest():
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]},
        {"role": "user", "content": "c", "name": "ann"},
    ]
    assert with_content_format(turns, "string") == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]},
        {"role": "user", "content": "c", "name": "ann"},
    ]
    assert with_content_format(turns, "openai") == [
        turns[0],
        {"role": "assistant", "content": [], "tool_calls": [{"id": "c"}]},
        {"role": "user", "content": [{"type": "text", "text": "c"}], "name": "ann"},
    ]


def test_a_message_with_images_reads_one_placeholder_line_per_image_then_its_texts_by_lines():
    """vLLM's string format for an image-text model: the images' placeholders, each on its line, before the texts
    joined by newlines (a message of images alone ends in an empty line); images come out in order."""
    turns = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "data:1"}},
                {"type": "text", "text": "b"},
                {"type": "image_url", "image_url": "data:2"},
            ],
        },
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:3"}}]},
        {"role": "assistant", "content": "c"},
    ]
    rendered, images = split_chat_images(turns, "<image>")
    assert rendered == [
        {"role": "user", "content": "<image>\n<image>\na\nb"},
        {"role": "user", "content": "<image>\n"},
        turns[2],
    ]
    assert images == ["data:1", "data:2", "data:3"]
