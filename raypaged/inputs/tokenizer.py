"""The model's tokenizer, as vLLM's ``--tokenizer-mode`` picks it: Hugging Face's (``hf``), or Mistral's own through
``mistral_common`` (``mistral``: ``tekken.json`` or ``tokenizer.model.v*``, wrapped by transformers'
``MistralCommonBackend``). ``auto`` takes Mistral's when the folder has a Mistral tokenizer and no Hugging Face one.

A Mistral tokenizer renders conversations with ``mistral_common``'s own request encoding (no Jinja chat template), and
structured outputs read its token bytes (``token_bytes``). No torch import here."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKENIZER_MODES = ("auto", "hf", "mistral")
MISTRAL_TOKENIZER_FILES = ("tekken.json", "tokenizer.model.v*")
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_mistral_tokenizer(folder: Path) -> bool:
    return any(any(folder.glob(pattern)) for pattern in MISTRAL_TOKENIZER_FILES)


def resolve_tokenizer_mode(mode: str, folder: Path) -> str:
    """``hf`` or ``mistral``: ``mode``, or for ``auto`` Mistral's when ``folder`` has a Mistral tokenizer and no Hugging
    Face one. ``mistral`` on a folder without a Mistral tokenizer is refused naming the files looked for."""
    if mode == "mistral":
        if not has_mistral_tokenizer(folder):
            raise ValueError(
                f"--tokenizer-mode mistral: {folder} has no Mistral tokenizer ({' or '.join(MISTRAL_TOKENIZER_FILES)})"
            )
        return "mistral"
    if (
        mode == "auto"
        and has_mistral_tokenizer(folder)
        and not any((folder / f).is_file() for f in _HF_TOKENIZER_FILES)
    ):
        return "mistral"
    return "hf"


def load_tokenizer(folder: Path, mode: str) -> PreTrainedTokenizerBase:
    """The tokenizer of ``folder`` in resolved ``mode`` (``resolve_tokenizer_mode``)."""
    if mode == "mistral":
        from transformers.tokenization_mistral_common import MistralCommonBackend

        return MistralCommonBackend.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def is_mistral(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` is Mistral's (``mistral_common`` through transformers' ``MistralCommonBackend``)."""
    return type(tokenizer).__name__ == "MistralCommonBackend"


def is_tekken(tokenizer: Any) -> bool:
    """Whether a Mistral tokenizer is Tekken (byte-level BPE), not SentencePiece (v1 to v3)."""
    return hasattr(tokenizer.tokenizer.instruct_tokenizer.tokenizer, "id_to_byte_piece")


def grammar_vocab(tokenizer: Any) -> tuple[list[bytes] | list[str], bool]:
    """A Mistral tokenizer's vocabulary as a grammar compiler reads it, by id, and whether it is SentencePiece's
    pieces (``▁`` for a space, ``<0xNN>`` for a byte: xgrammar's byte-fallback kind) rather than Tekken's bytes. A
    generated text follows its prompt, so a first token's ``▁`` is a space of the text like any other. A control
    token (``[INST]``, ``</s>``...) is empty, so that a grammar never produces one as text."""
    inner = tokenizer.tokenizer.instruct_tokenizer.tokenizer
    special = {*tokenizer.all_special_ids, tokenizer.unk_token_id}
    if is_tekken(tokenizer):
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

        ignore = SpecialTokenPolicy.IGNORE
        return [b"" if i in special else inner.id_to_byte_piece(i, ignore) for i in range(inner.n_words)], False
    return ["" if i in special else inner.id_to_piece(i) for i in range(inner.n_words)], True


def token_bytes(tokenizer: Any) -> list[bytes]:
    """A Tekken tokenizer's tokens as the bytes each stands for, by id (a control token as none)."""
    assert is_tekken(tokenizer), "SentencePiece's pieces are not bytes"
    vocab, _ = grammar_vocab(tokenizer)
    return cast(list[bytes], vocab)
