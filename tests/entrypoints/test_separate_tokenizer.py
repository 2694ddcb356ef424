"""``--tokenizer`` / ``LLM(tokenizer=...)``: a model folder without tokenizer files runs on the tokenizer
(and chat template) of another folder, as vLLM's."""

import shutil

import pytest

from raypaged import LLM, SamplingParams
from raypaged.entrypoints.cli import build_parser, engine_configs
from tests.conftest import TOKENIZER_FILES, make_tiny_model

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2_dir):
    """(a tiny model with SmolLM2's tokenizer, the same weights without any tokenizer file, a tokenizer-only
    folder whose chat template marks its replies)."""
    root = tmp_path_factory.mktemp("separate_tokenizer")
    whole = make_tiny_model(root, smollm2_dir)
    bare = root / "bare"
    shutil.copytree(whole, bare)
    for name in TOKENIZER_FILES:
        (bare / name).unlink(missing_ok=True)
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, tokenizer / name)
    (tokenizer / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
    )
    return whole, bare, tokenizer


def test_a_model_runs_on_another_folders_tokenizer_and_chat_template(folders):
    whole, bare, tokenizer = folders
    reference = LLM(model=str(whole), num_gpu_blocks_override=32, max_model_len=128)
    llm = LLM(model=str(bare), tokenizer=str(tokenizer), num_gpu_blocks_override=32, max_model_len=128)
    prompt = "The quick brown fox"
    want = reference.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0]
    got = llm.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0]
    assert (got.token_ids, got.text) == (want.token_ids, want.text)
    [chat] = llm.chat([{"role": "user", "content": "Hi"}], PARAMS, use_tqdm=False)
    assert chat.prompt == "[user] Hi\n[assistant]"  # the tokenizer folder's template


def test_the_flag_reaches_the_engine_and_a_foreign_tokenizer_is_refused(folders, tmp_path):
    whole, bare, tokenizer = folders
    [config] = engine_configs(build_parser().parse_args(["serve", str(bare), "--tokenizer", str(tokenizer)]))
    assert (config.model_path, config.tokenizer_path) == (bare, tokenizer)
    small = make_tiny_model(tmp_path, tokenizer, vocab_size=1000)  # SmolLM2's 49,152 tokens on a 1,000-row model
    with pytest.raises(
        ValueError,
        match=f"the tokenizer in {tokenizer} has 49152 tokens, more than the model's "
        "vocabulary of 1000: it is not this model's tokenizer",
    ):
        LLM(model=str(small), tokenizer=str(tokenizer), num_gpu_blocks_override=32, max_model_len=128)
