"""The model's tokenizer, as vLLM's ``--tokenizer-mode`` picks it: Hugging Face's (``hf``), or Mistral's own Tekken
tokenizer through ``mistral_common`` (``mistral``: ``tekken.json``, wrapped by transformers' ``MistralCommonBackend``).
``auto`` takes Mistral's when the folder has ``tekken.json`` and no Hugging Face tokenizer.

A Mistral tokenizer renders conversations with ``mistral_common``'s own request encoding (no Jinja chat template), and
structured outputs read its token bytes (``token_bytes``). Mistral's older SentencePiece tokenizers
(``tokenizer.model.v1`` to ``v3``) are refused in this mode: ``mistral_common`` reads them through the
``sentencepiece`` package, whose wheel maps an OpenMP runtime of its own beside torch's into the engine's process
(two runtimes oversubscribe the cores and are known to crash), and the repositories that carry them all ship the
same tokenizer in Hugging Face's format. No torch import here."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKENIZER_MODES = ("auto", "hf", "mistral")
TEKKEN = "tekken.json"
SENTENCEPIECE_GLOB = "tokenizer.model.v*"
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def resolve_tokenizer_mode(mode: str, folder: Path) -> str:
    """``hf`` or ``mistral``: ``mode``, or for ``auto`` Mistral's when ``folder`` has ``tekken.json`` and no Hugging
    Face tokenizer. ``mistral`` without ``tekken.json`` is refused, naming a SentencePiece tokenizer found instead."""
    tekken = (folder / TEKKEN).is_file()
    if mode == "mistral":
        if tekken:
            return "mistral"
        if found := sorted(folder.glob(SENTENCEPIECE_GLOB)):
            raise ValueError(
                f"--tokenizer-mode mistral reads Tekken tokenizers ({TEKKEN}); {folder} has SentencePiece's "
                f"{found[0].name}, which raypaged reads in Hugging Face's format: serve the repository's "
                "tokenizer.json (--tokenizer-mode hf)"
            )
        raise ValueError(f"--tokenizer-mode mistral: {folder} has no Mistral tokenizer ({TEKKEN})")
    if mode == "auto" and tekken and not any((folder / f).is_file() for f in _HF_TOKENIZER_FILES):
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


def token_bytes(tokenizer: Any) -> list[bytes]:
    """A Mistral (Tekken) tokenizer's tokens as the bytes each stands for, by id; a control token (``[INST]``,
    ``</s>``...) as no bytes, so that a grammar never produces one as text."""
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

    inner = tokenizer.tokenizer.instruct_tokenizer.tokenizer
    special = set(tokenizer.all_special_ids)
    ignore = SpecialTokenPolicy.IGNORE
    return [b"" if i in special else inner.id_to_byte_piece(i, ignore) for i in range(inner.n_words)]
