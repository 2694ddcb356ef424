"""xgrammar behind one small interface: compile a request's constraint (cached), make a matcher,
fill the token bitmasks of a step.

A compiled grammar is immutable and shared by every request with the same constraint; a
matcher is one sequence's position in it (advanced with each sampled token). Compiling is
thread-safe: servers compile off the engine thread, and the engine then finds it cached. At most
``COMPILE_SLOTS`` grammars compile at once: a constraint can take a core for a minute (a JSON schema of a few
thousand properties), and compiles on every core would slow every running stream.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from raypaged.inputs.limits import InputError
from raypaged.inputs.tokenizer import is_mistral, token_bytes
from raypaged.sampling_params import StructuredOutputsParams
from raypaged.structured import compile_trial
from raypaged.structured.config import StructuredOutputsConfig
from raypaged.structured.guidance import Guidance, GuidanceGrammar, GuidanceMatcher, unenforced_keyword
from raypaged.structured.reasoning import ReasoningParser

if TYPE_CHECKING:
    import torch
    import xgrammar
    from transformers import PreTrainedTokenizerBase

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: "
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
PARAM = "structured_outputs"
COMPILE_SLOTS = max(1, min((os.cpu_count() or 1) // 2, 8))  # grammars compiling at once (as vLLM's compile pool)


def grammar_bytes(compiled: xgrammar.CompiledGrammar | GuidanceGrammar) -> int:
    """The memory a compiled grammar takes: xgrammar's own count, or a guidance grammar's text."""
    if isinstance(compiled, GuidanceGrammar):
        return len(compiled.grammar)
    return int(compiled.memory_size_bytes)


class GrammarBackend:
    """One model's grammar compiler. ``stop_token_ids`` are the ids that end generation: the
    grammar allows them exactly where its output is complete."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        config: StructuredOutputsConfig,
    ) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None  # built on first use: most servers never need it
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()
        self._compiling = threading.BoundedSemaphore(COMPILE_SLOTS)
        self._cache: OrderedDict[tuple[str, ...], xgrammar.CompiledGrammar | GuidanceGrammar] = OrderedDict()
        self._cache_bytes = 0  # what the cached grammars take, by ``grammar_bytes``
        self._guidance = Guidance(tokenizer, vocab_size, stop_token_ids)
        self._trial_tokenizer: compile_trial.Tokenizer | None = None  # the compiler's tokenizer, as trials take it

    def _xgr_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:  # not the cache's lock: building it takes a while, and cache lookups never wait
            if self._compiler is None:
                import xgrammar as xgr

                if is_mistral(self._tokenizer):  # Tekken's tokens are raw bytes
                    info = xgr.TokenizerInfo(
                        token_bytes(self._tokenizer),
                        vocab_type=xgr.VocabType.RAW,
                        vocab_size=self._vocab_size,
                        stop_token_ids=self._stop_token_ids,
                    )
                else:
                    info = xgr.TokenizerInfo.from_huggingface(
                        self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
                    )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                if self.config.max_compile_s is not None:  # serializing the vocabulary takes about 40 ms
                    self._trial_tokenizer = compile_trial.Tokenizer.of(info)
            return self._compiler

    def compile(
        self, params: StructuredOutputsParams, reasoning: ReasoningParser | None = None
    ) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``params`` (from the cache when it was compiled before), behind
        ``reasoning``'s section when given; a constraint that does not compile raises
        ``InputError`` with the compiler's message."""
        key = self._key(params, reasoning)
        if (found := self._lookup(key)) is not None:
            return found
        any_whitespace = self._any_whitespace(params)
        with self._compiling:
            if (found := self._lookup(key)) is not None:  # compiled while this one waited
                return found
            try:
                if self._uses_guidance(params, reasoning):
                    compiled = self._guidance.compile(params, any_whitespace, self.config.max_whitespace)
                else:
                    self._try(params, any_whitespace, reasoning)
                    grammar = self.build(params, any_whitespace, self.config.max_whitespace)
                    compiled = self._xgr_compiler().compile_grammar(
                        grammar if reasoning is None else reasoning.after_section(grammar)
                    )
            except RecursionError:  # a JSON text nested past what the parsers recurse through
                raise InputError(PARAM, f"structured outputs: the {params.kind} constraint nests too deeply") from None
            self._check_can_start(compiled, params.kind)
        self._keep(key, compiled)
        return compiled

    def _try(self, params: StructuredOutputsParams, any_whitespace: bool, reasoning: ReasoningParser | None) -> None:
        """With ``max_compile_s``: compile ``params`` in a child first, and refuse it if that is not done in
        time (``compile_trial``)."""
        limit = self.config.max_compile_s
        if limit is None:
            return
        self._xgr_compiler()
        assert self._trial_tokenizer is not None
        name = reasoning.name if reasoning is not None else None
        try:
            compile_trial.try_compile(
                self._trial_tokenizer, params, any_whitespace, self.config.max_whitespace, name, limit
            )
        except compile_trial.CompileTooSlow:
            raise InputError(
                PARAM,
                f"structured outputs: the {params.kind} constraint did not compile within {limit:g} s "
                "(max_compile_s of --structured-outputs-config)",
            ) from None

    def _keep(self, key: tuple[str, ...], compiled: xgrammar.CompiledGrammar | GuidanceGrammar) -> None:
        """``compiled`` cached under ``key``; the least recently used go while more than ``cache_size``
        are kept or they take more than ``cache_mb``; a grammar larger than ``cache_mb`` alone is not kept."""
        limit, size = self.config.cache_mb << 20, grammar_bytes(compiled)
        with self._lock:
            if key in self._cache or size > limit:  # compiled twice at once (keep one), or too large to keep
                return
            self._cache[key] = compiled
            self._cache_bytes += size
            while len(self._cache) > self.config.cache_size or self._cache_bytes > limit:
                self._cache_bytes -= grammar_bytes(self._cache.popitem(last=False)[1])

    def cached(
        self, params: StructuredOutputsParams, reasoning: ReasoningParser | None = None
    ) -> xgrammar.CompiledGrammar | GuidanceGrammar | None:
        """``compile``'s grammar when it is cached, else ``None``; never waits for a compile."""
        return self._lookup(self._key(params, reasoning))

    def _lookup(self, key: tuple[str, ...]) -> xgrammar.CompiledGrammar | GuidanceGrammar | None:
        with self._lock:
            if (found := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
            return found

    def _any_whitespace(self, params: StructuredOutputsParams) -> bool:
        return not (
            self.config.disable_any_whitespace
            if params.disable_any_whitespace is None
            else params.disable_any_whitespace
        )

    def _key(self, params: StructuredOutputsParams, reasoning: ReasoningParser | None) -> tuple[str, ...]:
        return (params.kind, params.spec, str(self._any_whitespace(params)), reasoning.name if reasoning else "")

    @staticmethod
    def build(params: StructuredOutputsParams, any_whitespace: bool, max_whitespace: int | None) -> xgrammar.Grammar:
        """The xgrammar grammar of ``params`` (before it is compiled for a tokenizer)."""
        import xgrammar as xgr

        kind, spec = params.kind, params.spec
        whitespace = {
            "any_whitespace": any_whitespace,
            "max_whitespace_cnt": max_whitespace if any_whitespace else None,
        }
        try:
            if kind == "json":
                _check_json(spec, "json")
                return xgr.Grammar.from_json_schema(spec, **whitespace)
            if kind == "json_object":
                return xgr.Grammar.from_json_schema('{"type": "object"}', **whitespace)
            if kind == "regex":
                return xgr.Grammar.from_regex(spec)
            if kind == "choice":
                alternatives = " | ".join(_ebnf_string(choice) for choice in params.choice or ())
                return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
            if kind == "grammar":
                return xgr.Grammar.from_ebnf(spec)
            _check_json(spec, "structural_tag")
            return xgr.Grammar.from_structural_tag(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            if isinstance(exc, (InputError, RecursionError)):
                raise
            message = _LOCATION.sub("", str(exc).strip())
            raise InputError(PARAM, f"structured outputs: the {kind} constraint does not compile: {message}") from None

    def _check_can_start(self, compiled: xgrammar.CompiledGrammar, kind: str) -> None:
        """A grammar whose first token no token of this vocabulary can be would end every request
        that uses it at its first step, and one whose first mask takes more than ``max_grammar_ms``
        would stall every request of its batch: refuse either once, when it compiles."""
        bitmask = self.allocate_bitmask(1)
        limit, ms = self.config.max_grammar_ms, self._first_mask_ms(compiled, bitmask)
        if limit is not None and ms > limit:
            # the first mask a backend fills also builds what it keeps for later ones (llguidance: 0.9 s for
            # SmolLM2's vocabulary); a request's first mask costs what a second one does
            ms = self._first_mask_ms(compiled, bitmask)
        if limit is not None and ms > limit:
            raise InputError(
                PARAM,
                f"structured outputs: the {kind} constraint took {ms:.1f} ms of CPU for its first token's mask, more "
                f"than the limit of {limit:g} ms (max_grammar_ms of --structured-outputs-config)",
            )
        if not bool(bitmask.any()):
            raise InputError(
                PARAM, f"structured outputs: no token of this model's vocabulary can begin the {kind} constraint"
            )

    def _first_mask_ms(self, compiled: xgrammar.CompiledGrammar | GuidanceGrammar, bitmask: torch.Tensor) -> float:
        start = time.thread_time()
        self.matcher(compiled).fill_next_token_bitmask(bitmask, 0)
        return (time.thread_time() - start) * 1000

    def _uses_guidance(self, params: StructuredOutputsParams, reasoning: ReasoningParser | None) -> bool:
        """llguidance when configured, or (``auto``) for a JSON schema with a keyword xgrammar would
        not enforce; a constraint neither can enforce as asked raises ``InputError``."""
        backend = self.config.backend
        if backend == "guidance" or params.kind != "json":
            if backend == "guidance" and reasoning is not None:
                raise InputError(
                    PARAM, "structured outputs after a reasoning section need the xgrammar or auto backend"
                )
            return backend == "guidance"
        _check_json(params.spec, "json")
        found = unenforced_keyword(json.loads(params.spec))
        if found is None:
            return False
        keyword, where = found
        if backend == "xgrammar":
            raise InputError(
                PARAM,
                f"structured outputs: the xgrammar backend does not enforce the JSON schema "
                f"keyword {keyword!r} (at {where}); the guidance or auto backend may",
            )
        if reasoning is not None:
            raise InputError(
                PARAM,
                f"structured outputs: the JSON schema keyword {keyword!r} (at {where}) needs the "
                "guidance backend, which cannot follow a reasoning section",
            )
        try:
            self._guidance.compile(params, True, None)
        except InputError as exc:
            reason = str(exc).removeprefix("structured outputs: ")
            raise InputError(
                PARAM,
                f"structured outputs: no backend enforces the JSON schema keyword {keyword!r} "
                f"(at {where}): xgrammar ignores it, and {reason}",
            ) from None
        return True

    def matcher(
        self, compiled: xgrammar.CompiledGrammar | GuidanceGrammar
    ) -> xgrammar.GrammarMatcher | GuidanceMatcher:
        if isinstance(compiled, GuidanceGrammar):
            return self._guidance.matcher(compiled)
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return allocate_bitmask(num_rows, self._vocab_size)


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(vocab_size / 32)] int32 token masks, a set bit = an allowed token."""
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(num_rows, vocab_size)


def _check_json(spec: str, kind: str) -> None:
    try:
        json.loads(spec)
    except json.JSONDecodeError as exc:
        raise InputError(PARAM, f"structured outputs: {kind} is not valid JSON: {exc}") from None


def _ebnf_string(text: str) -> str:
    """``text`` as an EBNF string literal (JSON's escapes are the grammar's)."""
    return json.dumps(text, ensure_ascii=False)


def num_valid_tokens(matcher: xgrammar.GrammarMatcher | GuidanceMatcher, token_ids: list[int]) -> int:
    """How many of ``token_ids``, in order, ``matcher`` would accept now; it is left as it was."""
    if isinstance(matcher, GuidanceMatcher):
        return matcher.num_valid(token_ids)
    num_valid = 0
    for token_id in token_ids:  # xgrammar refuses a token without changing state
        if matcher.is_terminated() or not matcher.accept_token(token_id):
            break
        num_valid += 1
    if num_valid:
        matcher.rollback(num_valid)
    return num_valid
