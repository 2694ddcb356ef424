"""How a message's content reaches a chat template (vLLM's ``--chat-template-content-format``).

``string``: one string, a list of text parts joined by newlines (null content is ""). ``openai``: a list of
parts, as OpenAI's API sends them (a string becomes one text part, null content no part). ``auto``: ``openai``
where the template loops over a message's content (directly, or through a variable set from it), ``string``
otherwise, as vLLM detects it.
"""

from __future__ import annotations

import functools
from typing import Any

CONTENT_FORMATS = ("auto", "string", "openai")


def resolve_content_format(content_format: str, template: str | None) -> str:
    """``string`` or ``openai``: ``content_format``, or for ``auto`` what ``template`` reads."""
    if content_format != "auto":
        return content_format
    return "openai" if template is not None and _loops_over_content(template) else "string"


def with_content_format(conversation: list[dict[str, Any]], content_format: str) -> list[dict[str, Any]]:
    """The turns with their content in ``content_format`` (``string`` or ``openai``); turns already in it are
    kept as they are."""
    return [_turn(turn, content_format) for turn in conversation]


def _turn(turn: dict[str, Any], content_format: str) -> dict[str, Any]:
    content = turn.get("content")
    if content_format == "string":
        if isinstance(content, str):
            return turn
        texts = [
            part.get("text", "") for part in content or () if isinstance(part, dict) and part.get("type") == "text"
        ]
        return {**turn, "content": "\n".join(texts)}
    if isinstance(content, list):
        return turn
    return {**turn, "content": [] if content is None else [{"type": "text", "text": content}]}


@functools.lru_cache(maxsize=64)
def _loops_over_content(template: str) -> bool:
    """Whether the Jinja ``template`` has a ``for`` loop over some message's ``content`` (``message['content']``,
    ``message.content``, filtered or not, or a variable ``set`` from one). An unparsable template: no."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return False

    def reads_content(node: nodes.Node, names: set[str]) -> bool:
        while isinstance(node, nodes.Filter) and node.node is not None:  # content | selectattr(...)
            node = node.node
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
        if isinstance(node, nodes.Getattr):
            return node.attr == "content"
        return isinstance(node, nodes.Name) and node.name in names

    names: set[str] = set()
    for assign in tree.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and reads_content(assign.node, set()):
            names.add(assign.target.name)
    return any(reads_content(loop.iter, names) for loop in tree.find_all(nodes.For))
