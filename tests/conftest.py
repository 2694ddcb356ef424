"""Shared fixtures: the real SmolLM2 weights, Hugging Face references and tiny random Llamas."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from raypaged.model.default_model import default_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
RAY_NUM_CPUS = 8  # logical CPUs: enough for a tp=4 placement group on a 2-core machine


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", default=False,
                     help="tests/reliability at soak sizes (minutes), not the CI sizes")


@pytest.fixture(scope="session")
def soak(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--soak"))


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """The test session's one local Ray instance (tests/distributed, tests/reliability)."""
    import ray

    ray.init(address="local", num_cpus=RAY_NUM_CPUS, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_dir):
    from raypaged import LLM

    return LLM(model=str(smollm2_dir), dtype="float32", num_gpu_blocks_override=1024)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Transformers' own greedy decoding of one prompt, EOS ignored."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids):].tolist()


def make_tiny_model(root: Path, smollm2_dir: Path, arch: str = "llama", **overrides) -> Path:
    """A random-weight model folder of the given architecture with SmolLM2's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(overrides)
    config = AutoConfig.for_model(arch, **base)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)  # sharper than init, so greedy tokens are far from ties
    path = root / arch
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, path / name)
    return path
