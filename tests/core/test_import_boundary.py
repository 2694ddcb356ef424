"""The driver's pure-Python layers load without torch or transformers."""

import subprocess
import sys


def test_core_and_config_import_neither_torch_nor_transformers():
    code = (
        "import sys\n"
        "import raypaged, raypaged.core.scheduler, raypaged.core.block_manager, raypaged.config, "
        "raypaged.inputs.limits\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_public_names_still_import_from_the_package():
    code = (
        "from raypaged import LLM, SamplingParams, BeamSearchParams, RequestOutput, CompletionOutput; "
        "print(LLM.__name__)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "LLM"


def test_beam_search_params_live_where_vllm_has_them():
    from raypaged import BeamSearchParams as exported
    from raypaged.core.beam_search import BeamSearchParams as core
    from raypaged.sampling_params import BeamSearchParams

    assert BeamSearchParams is exported is core
