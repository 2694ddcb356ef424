"""Model folders with no weights, for ``load_format="dummy"`` runs (benchmarks, GPU checks).

A folder holds a Hugging Face ``config.json`` of a known shape and a word-level
tokenizer whose token ``i`` is the word ``t<i>`` (0, 1 and 2 are ``<unk>``, ``<s>`` and
``</s>``: one word per id, so decoding is the same in every process), so prompts can be
given as token ids and outputs still detokenize. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

# Llama-2-7B: 32 layers, 32 heads of 128, no GQA, 11008 MLP, 32000 tokens, 4096 context
LLAMA2_7B_SHAPE = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def write_synthetic_model(path: Path, **shape: object) -> Path:
    """A Llama model folder of ``shape`` (Llama-2-7B's by default) with a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    fields = {**LLAMA2_7B_SHAPE, **shape}
    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**fields)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, int(config.vocab_size))}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return path
