"""The ``guidance`` backend (llguidance) and what decides between it and xgrammar.

xgrammar compiles some JSON-schema keywords into nothing: an output it allows may then break the
schema (measured with xgrammar 0.2.9: ``not``, ``uniqueItems``, ``if``/``then``/``else``,
``dependentRequired``, ``dependentSchemas``, and ``allOf`` over several subschemas, of which it
keeps one). :func:`unenforced_keyword` finds them. With ``backend: auto`` (the default, as vLLM)
such a schema goes to llguidance, which enforces ``allOf`` and refuses by name what it cannot
enforce; with ``backend: xgrammar`` it is refused. ``oneOf`` is enforced as ``anyOf`` by both (an
output matches at least one branch; one matching several is not excluded). Objects whose schema
lists ``properties`` and says nothing of ``additionalProperties`` get no other properties in
either backend (xgrammar's strict mode; :func:`closed_objects` for llguidance), so outputs end.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from raypaged.inputs.limits import InputError
from raypaged.inputs.tokenizer import is_mistral, token_bytes
from raypaged.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance
    import torch
    from transformers import PreTrainedTokenizerBase

PARAM = "structured_outputs"
_IGNORED_BY_XGRAMMAR = ("not", "uniqueItems", "if", "then", "else", "dependentRequired", "dependentSchemas")
# the constraint kinds llguidance takes here (EBNF grammars and structural tags are xgrammar's)
GUIDANCE_KINDS = ("json", "json_object", "regex", "choice")
_VALUE_KEYWORDS = ("const", "enum", "default", "examples")  # their values are JSON values, not subschemas


def unenforced_keyword(schema: Any, path: str = "#") -> tuple[str, str] | None:
    """(keyword, where) of the first keyword in ``schema`` that xgrammar would not enforce."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            if (found := unenforced_keyword(item, f"{path}/{i}")) is not None:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for keyword in _IGNORED_BY_XGRAMMAR:
        if keyword in schema and not (keyword == "uniqueItems" and schema[keyword] is False):
            return keyword, path
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "allOf", path
    for key, value in schema.items():
        if key in _VALUE_KEYWORDS:
            continue
        if (found := unenforced_keyword(value, f"{path}/{key}")) is not None:
            return found
    return None


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` wherever an object lists ``properties`` and
    leaves it unsaid (a copy)."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: value if key in _VALUE_KEYWORDS else closed_objects(value) for key, value in schema.items()}
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


class GuidanceGrammar:
    """A constraint checked by llguidance: its grammar text, ready for a matcher."""

    __slots__ = ("grammar", "kind")

    def __init__(self, grammar: str, kind: str) -> None:
        self.grammar = grammar
        self.kind = kind


class GuidanceMatcher:
    """One sequence's position in a :class:`GuidanceGrammar`, with the interface of xgrammar's
    ``GrammarMatcher`` that the engine uses."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, index)
        if self._matcher.is_error():
            raise RuntimeError(self._matcher.get_error())

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id)

    def is_terminated(self) -> bool:
        """Complete: nothing but EOS can follow."""
        return self._matcher.is_stopped()

    def num_valid(self, token_ids: list[int]) -> int:
        """How many of ``token_ids``, in order, the grammar would accept now (nothing changes)."""
        return self._matcher.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` accepted tokens (drafts checked, then given back)."""
        self._matcher.rollback(num_tokens)

    def fork(self) -> GuidanceMatcher:
        return GuidanceMatcher(self._matcher.deep_copy())


class Guidance:
    """llguidance for one model's tokenizer (built on first use)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(stop_token_ids)[:1] or None
        self._tokenizer: llguidance.LLTokenizer | None = None

    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            eos = self._eos[0] if self._eos else None
            if is_mistral(self._hf_tokenizer):
                from llguidance import LLTokenizer, TokenizerWrapper

                wrapped = TokenizerWrapper(_MistralTokens(self._hf_tokenizer, eos))
                self._tokenizer = LLTokenizer(wrapped, n_vocab=self._vocab_size)
            else:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=eos
                )
        return self._tokenizer

    def compile(
        self, params: StructuredOutputsParams, any_whitespace: bool, max_whitespace: int | None
    ) -> GuidanceGrammar:
        """The constraint as a checked llguidance grammar; one it cannot enforce raises ``InputError``."""
        from llguidance import LLMatcher

        kind, spec = params.kind, params.spec
        if kind not in GUIDANCE_KINDS:
            raise InputError(
                PARAM,
                f"structured outputs: the guidance backend takes {', '.join(GUIDANCE_KINDS)} "
                f"constraints; a {kind} constraint needs the xgrammar backend",
            )
        if kind in ("json", "json_object"):
            schema = json.dumps(closed_objects(json.loads(spec))) if kind == "json" else '{"type": "object"}'
            options: dict[str, Any] = {"whitespace_flexible": any_whitespace, "coerce_one_of": True}
            if not any_whitespace:
                options["item_separator"], options["key_separator"] = ", ", ": "
            elif max_whitespace is not None:
                options["whitespace_pattern"] = f"[ \\n\\t]{{0,{max_whitespace}}}"
            try:
                grammar = LLMatcher.grammar_from_json_schema(schema, defaults=options)
            except ValueError as exc:
                raise InputError(PARAM, f"structured outputs: {kind} is not valid JSON: {exc}") from None
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(spec)
        else:
            grammar = LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in params.choice or ())
            )
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer())
        if is_error or messages:  # a warning is a keyword it would not enforce: refused, never ignored
            raise InputError(
                PARAM,
                f"structured outputs: the guidance backend cannot enforce the {kind} constraint: {'; '.join(messages)}",
            )
        return GuidanceGrammar(grammar, kind)

    def matcher(self, compiled: GuidanceGrammar) -> GuidanceMatcher:
        from llguidance import LLMatcher

        return GuidanceMatcher(LLMatcher(self.tokenizer(), compiled.grammar, log_level=0))


class _MistralTokens:
    """Mistral's tokenizer as llguidance's ``TokenizerWrapper`` reads one: each token's bytes (a control token as
    0xFF and its name, llguidance's mark of a special token), the special ids, and an encoder of text."""

    def __init__(self, tokenizer: Any, eos_token_id: int | None) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = eos_token_id if eos_token_id is not None else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = list(tokenizer.all_special_ids)
        self.tokens = token_bytes(tokenizer)
        for token_id, name in zip(self.special_token_ids, tokenizer.convert_ids_to_tokens(self.special_token_ids)):
            self.tokens[token_id] = b"\xff" + name.encode()

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)
