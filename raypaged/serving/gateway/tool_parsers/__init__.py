"""Tool-call parsers for ``tool_choice: "auto"`` (``--tool-call-parser NAME``), one module each."""

from __future__ import annotations

from raypaged.serving.gateway.tool_parsers.base import StreamingToolCalls, ToolCall, ToolParser
from raypaged.serving.gateway.tool_parsers.deepseek import DeepSeekV3Parser, DeepSeekV31Parser
from raypaged.serving.gateway.tool_parsers.glm45 import Glm45Parser
from raypaged.serving.gateway.tool_parsers.granite import GraniteParser
from raypaged.serving.gateway.tool_parsers.hermes import HermesParser
from raypaged.serving.gateway.tool_parsers.kimi_k2 import KimiK2Parser
from raypaged.serving.gateway.tool_parsers.llama3_json import Llama3JsonParser
from raypaged.serving.gateway.tool_parsers.llama4_pythonic import Llama4PythonicParser
from raypaged.serving.gateway.tool_parsers.mistral import MistralParser
from raypaged.serving.gateway.tool_parsers.openai import OpenAIParser
from raypaged.serving.gateway.tool_parsers.phi4_mini_json import Phi4MiniJsonParser
from raypaged.serving.gateway.tool_parsers.pythonic import PythonicParser
from raypaged.serving.gateway.tool_parsers.qwen3_coder import Qwen3CoderParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (
        DeepSeekV3Parser,
        DeepSeekV31Parser,
        Glm45Parser,
        GraniteParser,
        HermesParser,
        KimiK2Parser,
        Llama3JsonParser,
        Llama4PythonicParser,
        MistralParser,
        OpenAIParser,
        Phi4MiniJsonParser,
        PythonicParser,
        Qwen3CoderParser,
    )
}


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not supported; supported: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


__all__ = ["PARSERS", "StreamingToolCalls", "ToolCall", "ToolParser", "get_parser"]
