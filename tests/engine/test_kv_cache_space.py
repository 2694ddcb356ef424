"""The CPU KV cache's size without a flag: ``$RAYPAGED_CPU_KVCACHE_SPACE`` GiB (vLLM's
``VLLM_CPU_KVCACHE_SPACE``), else 4 GiB; ``--kv-cache-space`` wins over it."""

import pytest

from raypaged import LLM
from tests.conftest import make_tiny_model

# the tiny Llama in fp32: K and V of 2 layers x 2 KV heads x 8 dims x 16 tokens x 4 bytes
BLOCK_BYTES = 2 * 2 * 2 * 8 * 16 * 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    return make_tiny_model(tmp_path_factory.mktemp("kv_space"), smollm2_dir)


def test_the_environment_sizes_the_cache_the_flag_wins_and_4_gib_is_the_default(tiny, monkeypatch):
    monkeypatch.setenv("RAYPAGED_CPU_KVCACHE_SPACE", "0.01")
    llm = LLM(model=str(tiny), dtype="float32")
    try:
        assert llm.llm_engine.stats().num_gpu_blocks_total == int(0.01 * 2**30) // BLOCK_BYTES == 2621
        executor = llm.llm_engine.core.executor
        monkeypatch.delenv("RAYPAGED_CPU_KVCACHE_SPACE")
        assert executor.determine_num_blocks() == (4 * 2**30 // BLOCK_BYTES, 0)  # sized, not allocated
        monkeypatch.setenv("RAYPAGED_CPU_KVCACHE_SPACE", "lots")
        with pytest.raises(ValueError, match=r"^\$RAYPAGED_CPU_KVCACHE_SPACE must be a positive float, got 'lots'$"):
            executor.determine_num_blocks()
    finally:
        llm.shutdown()
    llm = LLM(model=str(tiny), dtype="float32", kv_cache_space=0.02)
    try:
        assert llm.llm_engine.stats().num_gpu_blocks_total == int(0.02 * 2**30) // BLOCK_BYTES
    finally:
        llm.shutdown()
