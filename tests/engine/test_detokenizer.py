import pytest
from transformers import AutoTokenizer

from raypaged.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "Emoji split across tokens: 🦙🚀👩‍👩‍👧 done.",
    "中文分词测试，日本語のテキスト、한국어 텍스트.",
    "  leading spaces\n\tand\ttabs  and   runs of   spaces",
    "<|im_start|>assistant\nspecial tokens<|im_end|>",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(params=["stream", "window"])
def make_detokenizer(request):
    """Both decoders: ``DecodeStream`` (fast tokenizers) and the window decoder (the others)."""

    def make(tokenizer, prompt_ids, skip_special_tokens=True):
        detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        if request.param == "window":
            detok._stream = None
        return detok

    return make


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_deltas_are_valid_and_add_up(tokenizer, make_detokenizer, text):
    prompt_ids = tokenizer("Say:")["input_ids"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = make_detokenizer(tokenizer, prompt_ids)
    deltas = [detok.add_tokens([token]) for token in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_split_character_is_held_back_until_complete(tokenizer, make_detokenizer):
    ids = tokenizer("🦙", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # byte-level BPE splits this emoji
    detok = make_detokenizer(tokenizer, [])
    assert [detok.add_tokens([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add_tokens(ids[-1:]) == "🦙"


def test_flush_gives_what_an_unfinished_character_left(tokenizer, make_detokenizer):
    ids = tokenizer("a🦙", add_special_tokens=False)["input_ids"]
    detok = make_detokenizer(tokenizer, [])
    text = "".join(detok.add_tokens([t]) for t in ids[:-1])
    assert text == "a"
    rest = detok.flush()
    assert rest == tokenizer.decode(ids[1:-1]) and rest.endswith("\ufffd")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_decode_as_the_whole_sequence_does(tokenizer, make_detokenizer, skip_special_tokens):
    import random

    rng = random.Random(0)
    prompt = tokenizer("Context:")["input_ids"]
    for _ in range(20):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        detok = make_detokenizer(tokenizer, prompt, skip_special_tokens)
        text = "".join(detok.add_tokens([t]) for t in ids) + detok.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_spaces_between_special_tokens_off_joins_consecutive_special_tokens(tmp_path):
    """vLLM's ``spaces_between_special_tokens=False`` with special tokens kept: a special token right
    after another comes without the space between them (a word-level tokenizer puts one before every
    token); other tokens keep theirs, and with the default both are spaced. (Slow tokenizers, on the
    window decoder, get the flag from their own ``decode``.)"""
    from raypaged.model.synthetic import write_synthetic_model

    tokenizer = AutoTokenizer.from_pretrained(
        write_synthetic_model(
            tmp_path / "words",
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    ids = [5, 1, 2, 6, 2, 2, 7]  # t5 <s> </s> t6 </s> </s> t7

    def text(spaces: bool) -> str:
        detok = IncrementalDetokenizer(
            tokenizer, [3, 4], skip_special_tokens=False, spaces_between_special_tokens=spaces
        )
        return "".join(detok.add_tokens([token]) for token in ids) + detok.flush()

    assert text(True).strip() == "t5 <s> </s> t6 </s> </s> t7"
    assert text(False).strip() == "t5 <s></s> t6 </s></s> t7"
