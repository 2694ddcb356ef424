"""Embedding models (``runner="pooling"``): every vector equals transformers' base model's final hidden states,
pooled (last token, mean, first token), cut to matryoshka dimensions and normalized as asked; what an embedding
model cannot do is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel

from raypaged import LLM, PoolingParams, SamplingParams
from raypaged.config import DEFAULT_STEP_TOKENS, EngineConfig
from raypaged.pooling import resolve_pooler
from tests.conftest import make_tiny_embedding_model, make_tiny_model

# a 37-token prompt is three chunks under a 16-token step budget; the others share steps with it
PROMPTS = [list(range(100, 137)), [5, 9, 300], [42] * 20, list(range(3000, 3077, 7))]
OPTIONS = {"device": "cpu", "num_gpu_blocks_override": 64, "block_size": 4, "max_model_len": 64}
CHUNKED = {"max_num_batched_tokens": 16, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_tiny_embedding_model(tmp_path_factory.mktemp("embedding"), smollm2_dir, "qwen3", head_dim=16)


@pytest.fixture(scope="module")
def hf_base(embedding_dir):
    return AutoModel.from_pretrained(embedding_dir, dtype=torch.float32).eval()


def final_states(model, prompt: list[int]) -> torch.Tensor:
    """transformers' base model: the prompt's final hidden states (after the final norm)."""
    with torch.inference_mode():
        return model(torch.tensor([prompt])).last_hidden_state[0]


@pytest.fixture(scope="module")
def hidden_states(hf_base) -> list[torch.Tensor]:
    return [final_states(hf_base, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def llm(embedding_dir):
    llm = LLM(model=str(embedding_dir), **OPTIONS)  # runner auto: Qwen3Model has no head, so it pools
    yield llm
    llm.shutdown()


def pooled(hidden: torch.Tensor, pooling_type: str, normalize: bool = True, dimensions: int | None = None):
    vector = {"LAST": hidden[-1], "CLS": hidden[0], "MEAN": hidden.mean(0)}[pooling_type][:dimensions]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def embeddings(llm: LLM, prompts=PROMPTS, **options) -> list[torch.Tensor]:
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False, **options)
    return [torch.tensor(o.outputs.embedding) for o in outputs]


def assert_close(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape
        assert (g - e).abs().max().item() < 2e-6


def test_last_token_embeddings_equal_transformers(llm, hidden_states):
    config = llm.llm_engine.config
    assert config.pooler is not None and (config.pooler.pooling_type, config.pooler.normalize) == ("LAST", True)
    assert config.enable_prefix_caching  # the last token is always computed: a cached prefix skips nothing it reads
    assert_close(embeddings(llm), [pooled(h, "LAST") for h in hidden_states])
    again = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)  # from the prefix cache
    assert [o.num_cached_tokens for o in again] == [36, 0, 16, 8]
    assert_close([torch.tensor(o.outputs.embedding) for o in again], [pooled(h, "LAST") for h in hidden_states])
    assert llm.stats()["num_gpu_blocks_free"] == 64
    encoded = llm.encode({"prompt_token_ids": PROMPTS[1]}, PoolingParams(normalize=False), use_tqdm=False)
    assert encoded[0].outputs.data.dtype == torch.float32
    assert_close([encoded[0].outputs.data], [pooled(hidden_states[1], "LAST", normalize=False)])


@pytest.mark.parametrize(
    "pooler_config", [{"pooling_type": "MEAN"}, {"pooling_type": "CLS", "normalize": False}], ids=["mean", "cls"]
)
def test_chunked_mean_and_first_token_embeddings_equal_transformers(embedding_dir, hidden_states, pooler_config):
    llm = LLM(model=str(embedding_dir), pooler_config=pooler_config, **OPTIONS, **CHUNKED)
    try:
        assert not llm.llm_engine.config.enable_prefix_caching  # these read tokens a cached prefix would skip
        got = embeddings(llm)
        assert llm.stats()["num_gpu_blocks_free"] == 64
    finally:
        llm.shutdown()
    kind, normalize = pooler_config["pooling_type"], pooler_config.get("normalize", True)
    assert_close(got, [pooled(h, kind, normalize) for h in hidden_states])


def test_a_generative_checkpoint_converted(tmp_path, smollm2_dir, hidden_states):
    """The causal LM the embedding checkpoint came from, served with runner pooling (its lm_head skipped)."""
    causal = make_tiny_model(tmp_path, smollm2_dir, "qwen3", head_dim=16)
    llm = LLM(model=str(causal), convert="embed", **OPTIONS)
    try:
        assert llm.llm_engine.config.pooler is not None and llm.llm_engine.executor.worker.model.lm_head is None
        assert_close(embeddings(llm), [pooled(h, "LAST") for h in hidden_states])
        with pytest.raises(ValueError, match=r"is an embedding model \(--runner pooling\): it serves embeddings"):
            llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()


def test_request_options(llm, hf_base):
    truncated = final_states(hf_base, PROMPTS[0][-5:])  # the prompt's last 5 tokens, alone
    assert_close(embeddings(llm, [PROMPTS[0]], truncate_prompt_tokens=5), [pooled(truncated, "LAST")])
    text = [torch.tensor(o.outputs.embedding) for o in llm.embed(["hello world"], use_tqdm=False)]
    ids = llm.get_tokenizer()("hello world")["input_ids"]
    assert_close(text, embeddings(llm, [ids]))
    with pytest.raises(ValueError, match=r"^Model does not support matryoshka representation"):
        llm.embed("hi", PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match=r"maximum context length is 64 tokens. However, you requested 65 tokens"):
        llm.embed({"prompt_token_ids": [7] * 65}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"normalize \(True\) and use_activation \(False\) are the same switch"):
        PoolingParams(normalize=True, use_activation=False)


def test_matryoshka_dimensions(embedding_dir, hidden_states):
    llm = LLM(model=str(embedding_dir), hf_overrides={"matryoshka_dimensions": [16, 32]}, **OPTIONS)
    try:
        assert_close(
            embeddings(llm, pooling_params=PoolingParams(dimensions=16)),
            [pooled(h, "LAST", dimensions=16) for h in hidden_states],
        )
        with pytest.raises(ValueError, match=r"^Model only supports \[16, 32\] for matryoshka representation, got 20"):
            llm.embed("hi", PoolingParams(dimensions=20), use_tqdm=False)
    finally:
        llm.shutdown()


def test_sentence_transformers_modules(tmp_path):
    config = AutoConfig.for_model("qwen3", hidden_size=64)

    def write(modules: list[tuple[str, str]], pooling: dict | None = None) -> Path:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        entries = [
            {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{t}"}
            for i, (t, p) in enumerate(modules)
        ]
        (folder / "modules.json").write_text(json.dumps(entries))
        if pooling is not None:
            (folder / "1_Pooling").mkdir()
            (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        return folder

    mean = {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}
    both = [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")]
    settings = resolve_pooler(write(both, mean), config, None)
    assert (settings.pooling_type, settings.normalize, settings.matryoshka) == ("MEAN", True, None)
    settings = resolve_pooler(write(both[:2], {"pooling_mode_lasttoken": True}), config, {"normalize": True})
    assert (settings.pooling_type, settings.normalize) == ("LAST", True)
    assert resolve_pooler(write(both[:2], {"pooling_mode_cls_token": True}), config, None).normalize is False
    relu = write([*both[:2], ("Dense", "2_Dense")], mean)
    (relu / "2_Dense").mkdir()
    dense = {"in_features": 64, "out_features": 8, "activation_function": "torch.nn.modules.activation.ReLU"}
    (relu / "2_Dense" / "config.json").write_text(json.dumps(dense))
    with pytest.raises(ValueError, match=r"Dense activation 'torch.nn.modules.activation.ReLU' \(2_Dense\) is not sup"):
        resolve_pooler(relu, config, None)
    with pytest.raises(
        ValueError, match=r"module 'sentence_transformers.models.Dense' \(2_Dense\) is out of the order"
    ):
        resolve_pooler(write([both[0], ("Dense", "2_Dense"), both[1]], mean), config, None)
    with pytest.raises(ValueError, match=r"pooling \['pooling_mode_max_tokens'\] in 1_Pooling/config.json"):
        resolve_pooler(write(both[:2], {"pooling_mode_max_tokens": True}), config, None)
    with pytest.raises(ValueError, match=r"^--pooler-config 'softmax' is not supported"):
        resolve_pooler(tmp_path, config, {"softmax": True})
    with pytest.raises(ValueError, match=r"pooling_type 'STEP' is not supported \(supported: LAST, MEAN, CLS\)"):
        resolve_pooler(tmp_path, config, {"pooling_type": "STEP"})


def test_what_an_embedding_model_cannot_do_is_refused(embedding_dir, smollm2_dir):
    with pytest.raises(ValueError, match=r"has no language-model head, so it cannot generate: serve it with --runner"):
        LLM(model=str(embedding_dir), runner="generate", **OPTIONS)
    with pytest.raises(ValueError, match=r"^--speculative-config applies to generation: an embedding model"):
        LLM(model=str(embedding_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **OPTIONS)
    with pytest.raises(ValueError, match=r"^--pooler-config applies to embedding models \(--runner pooling\)"):
        LLM(model=str(smollm2_dir), pooler_config={"pooling_type": "MEAN"}, **OPTIONS)


def embedding_gemma(root: Path, smollm2_dir: Path) -> Path:
    """An EmbeddingGemma-shaped folder: a Gemma 3 base model with use_bidirectional_attention (a sliding layer of 4
    and a global one) and sentence-transformers modules: mean pooling, two Dense projections (64 -> 96 -> 64, no
    bias, identity) and Normalize, as google/embeddinggemma-300m's."""
    from safetensors.torch import save_file

    path = make_tiny_embedding_model(
        root,
        smollm2_dir,
        "gemma3_text",
        head_dim=16,
        num_key_value_heads=1,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
        use_bidirectional_attention=True,
    )
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True})
    )
    generator = torch.Generator().manual_seed(1)
    for folder, (n_in, n_out) in (("2_Dense", (64, 96)), ("3_Dense", (96, 64))):
        (path / folder).mkdir()
        dense = {
            "in_features": n_in,
            "out_features": n_out,
            "bias": False,
            "activation_function": "torch.nn.modules.linear.Identity",
        }
        (path / folder / "config.json").write_text(json.dumps(dense))
        save_file(
            {"linear.weight": torch.randn(n_out, n_in, generator=generator) * 0.1}, path / folder / "model.safetensors"
        )
    (path / "4_Normalize").mkdir()
    return path


def test_embedding_gemma_attends_both_ways_and_runs_its_dense_projections(tmp_path_factory, smollm2_dir, monkeypatch):
    """Bidirectional attention over whole prompts (the sliding layer's window on either side), mean pooling, the two
    Dense projections and the normalization: transformers' Gemma3TextModel and the modules' own weights, within
    2e-6; prompts are never cut (a budget of 64 tokens waits for room), and generation is refused."""
    from safetensors.torch import load_file

    path = embedding_gemma(tmp_path_factory.mktemp("embeddinggemma"), smollm2_dir)
    hf = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    dense = [load_file(path / f / "model.safetensors")["linear.weight"] for f in ("2_Dense", "3_Dense")]
    expected = []
    for prompt in PROMPTS:
        vector = final_states(hf, prompt).mean(0)
        for weight in dense:
            vector = weight @ vector
        expected.append(torch.nn.functional.normalize(vector, dim=-1))
    monkeypatch.setitem(DEFAULT_STEP_TOKENS, "cpu", 16)  # a prompt is computed whole: the budget holds the longest
    default = EngineConfig(model=str(path), device="cpu")
    assert default.max_num_batched_tokens == default.resolved_max_model_len == 512
    monkeypatch.undo()
    llm = LLM(model=str(path), **{**OPTIONS, "max_num_batched_tokens": 64})
    try:
        assert llm.llm_engine.config.whole_prompts and not llm.llm_engine.config.enable_prefix_caching
        for got, want in zip(embeddings(llm), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match=r"use_bidirectional_attention attends to whole prompts: it embeds"):
        LLM(model=str(path), hf_overrides={"architectures": ["Gemma3ForCausalLM"]}, **OPTIONS)
