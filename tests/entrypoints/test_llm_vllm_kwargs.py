"""``LLM(**kwargs)`` as vLLM users write it: every engine field is a keyword with the config's default,
vLLM's engine arguments that change nothing here are accepted at the value they take, and anything
else is refused by name (an unknown keyword with the closest one there is)."""

import dataclasses
import inspect

import pytest

from raypaged import LLM, SamplingParams
from raypaged.config import EngineConfig
from tests.serving.conftest import tiny_model_dir  # noqa: F401  (session fixture)


def test_every_engine_field_is_an_llm_keyword_with_the_same_default():
    keywords = inspect.signature(LLM).parameters
    # the server-only fields: its clients' names for the model and whether requests may bring templates
    server_only = {"served_model_name", "trust_request_chat_template"}
    for f in dataclasses.fields(EngineConfig):
        if not f.init or f.name in server_only:
            continue
        assert f.name in keywords, f.name
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        # None stands for the config's own default object (limits, structured outputs)
        assert keywords[f.name].default in (default, None), f.name


def test_vllm_engine_arguments_are_taken_at_the_values_that_change_nothing(tiny_model_dir):
    llm = LLM(
        model=str(tiny_model_dir),
        num_gpu_blocks_override=16,
        max_model_len=128,
        trust_remote_code=True,
        disable_log_stats=True,
        enable_chunked_prefill=True,
        pipeline_parallel_size=1,
        tokenizer_mode="auto",
        distributed_executor_backend="ray",
        max_num_partial_prefills=1,
        disable_custom_all_reduce=True,
        max_seq_len_to_capture=8192,
        task="generate",
        compilation_config="0",
        chat_template_content_format="string",
        limit_mm_per_prompt={"image": 0},  # text only, as an image-text checkpoint's language model is served
    )
    [output] = llm.generate("hi", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            {"data_parallel_size": 2},
            ValueError,
            "data_parallel_size=2 is not supported: this runs one engine; `raypaged serve -dp N` runs N engine "
            "processes behind its gateway, and `raypaged gateway` balances over the engines named with --engine "
            "NAME=host:port, once per rank",
        ),
        (
            {"calculate_kv_scales": True},
            ValueError,
            "--calculate-kv-scales sets an fp8 KV cache's scales: it needs --kv-cache-dtype fp8 (the cache is the "
            "model's dtype, which takes no scales)",
        ),
        (
            {"data_parallel_size": 2},
            ValueError,
            "data_parallel_size=2 is not supported: this runs one engine; `raypaged serve -dp N` runs N engine "
            "processes behind its gateway, and `raypaged gateway` balances over the engines named with --engine "
            "NAME=host:port, once per rank",
        ),
        (
            {"sleep_mode_backend": "criu"},
            ValueError,
            "sleep_mode_backend='criu' is not supported: enable_sleep_mode releases the weights and the KV cache by "
            "freeing them, and wake_up reads the weights back from the checkpoint (no cumem allocator)",
        ),
        (
            {"enable_chunked_prefill": False},
            ValueError,
            "enable_chunked_prefill=False is not supported: long prefills are always chunked within "
            "max_num_batched_tokens",
        ),
        (
            {"max_num_partial_prefills": 2},
            ValueError,
            "max_num_partial_prefills=2 is not supported: prompts are chunked within the step's max_num_batched_tokens "
            "and long_prefill_token_threshold, with no other bound on how many are partly prefilled at once, as vLLM "
            "V1's scheduler; only its default 1 is taken",
        ),
        (
            {"gpu_memory_utilisation": 0.5},
            TypeError,
            "LLM got an unexpected keyword argument 'gpu_memory_utilisation'; did you mean 'gpu_memory_utilization'?",
        ),
        (
            {"speculative_model": "x"},
            TypeError,
            "LLM got an unexpected keyword argument 'speculative_model'; did you mean 'speculative_config'?",
        ),
        ({"no_such_thing": 1}, TypeError, "LLM got an unexpected keyword argument 'no_such_thing'"),
    ],
)
def test_anything_else_is_refused_by_name_before_a_model_loads(kwargs, error, message):
    with pytest.raises(error) as info:
        LLM(model="/no/such/model", **kwargs)
    assert str(info.value) == message
