"""LoRARequest and LoRAConfig validation, with exact errors; neither imports torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from raypaged.lora.config import LoRAConfig
from raypaged.lora.request import LoRARequest


def test_request_equality_is_by_name_as_vllm():
    a = LoRARequest("sql", 1, "/adapters/sql")
    assert a == LoRARequest("sql", 2, "/elsewhere/sql")
    assert a != LoRARequest("chat", 1, "/adapters/sql")
    assert len({a, LoRARequest("sql", 1, "/adapters/sql")}) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", 1, "/p"), "a LoRA adapter needs a non-empty lora_name"),
        (("a", 0, "/p"), "lora_int_id must be a positive integer, got 0"),
        (("a", True, "/p"), "lora_int_id must be a positive integer, got True"),
        (("a", 1, ""), "LoRA adapter 'a' needs a lora_path"),
    ],
)
def test_request_validation(args, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        LoRARequest(*args)


def test_config_defaults_and_validation():
    assert LoRAConfig(max_loras=4).num_cpu_loras == 4
    assert LoRAConfig(max_loras=2, max_cpu_loras=8).num_cpu_loras == 8
    with pytest.raises(ValueError, match=r"^--max-loras must be at least 1, got 0$"):
        LoRAConfig(max_loras=0)
    with pytest.raises(ValueError, match=r"^--max-lora-rank must be at least 1, got 0$"):
        LoRAConfig(max_lora_rank=0)
    with pytest.raises(
        ValueError,
        match=r"^--max-cpu-loras 2 is below --max-loras 4: every adapter on the device is "
        r"also kept on the CPU$",
    ):
        LoRAConfig(max_loras=4, max_cpu_loras=2)


def test_driver_side_modules_import_no_torch():
    code = (
        "import sys, raypaged.lora.request, raypaged.lora.config; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
