"""vLLM engine options raypaged takes at one value only, shared by the command line and ``LLM(**kwargs)``:
each is honoured at that value and refused by name at any other."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# option (as a keyword), its short flag, type, the values taken, why another is refused
DEFAULT_ONLY: list[tuple[str, str | None, type, tuple[object, ...], str]] = [
    ("pipeline_parallel_size", "-pp", int, (1,), "pipeline parallelism is not implemented: shard layers with -tp"),
    ("data_parallel_size", "-dp", int, (1,), "run one server per replica behind a load balancer (see deploy/)"),
    ("max_long_partial_prefills", None, int, (1,), "the scheduler prefills one prompt in chunks at a time"),
    ("long_prefill_token_threshold", None, int, (0,), "the scheduler prefills one prompt in chunks at a time"),
    ("cpu_offload_gb", None, float, (0.0,), "weights stay on the device"),
    ("tokenizer_mode", None, str, ("auto",), "the model's own (fast) tokenizer is used"),
    ("distributed_executor_backend", None, str, (None, "ray"), "shards are Ray actors (ray)"),
    (
        "enable_chunked_prefill",
        None,
        bool,
        (None, True),
        "long prefills are always chunked within {max_num_batched_tokens}",
    ),
    (
        "max_num_partial_prefills",
        None,
        int,
        (1,),
        "the scheduler chunks one prompt at a time (a prompt cut at the step's {max_num_batched_tokens} is its last; "
        "the prompts behind it wait for the next step), which is {max_num_partial_prefills} 1",
    ),
    ("task", None, str, ("auto", "generate"), "raypaged serves generative models only (no embedding or scoring)"),
    ("runner", None, str, ("auto", "generate"), "raypaged serves generative models only (no pooling runner)"),
    (
        "compilation_config",
        "-O",
        str,
        (None, "0"),
        "the model is not compiled with torch.compile (level 0); CUDA graphs are on unless {enforce_eager}",
    ),
    ("enable_sleep_mode", None, bool, (False,), "the engine keeps its weights and KV cache for its lifetime"),
    ("skip_tokenizer_init", None, bool, (False,), "the engine tokenizes prompts and detokenizes outputs itself"),
    ("model_impl", None, str, ("auto",), "raypaged runs its own implementation of each supported architecture"),
    ("config_format", None, str, ("auto", "hf"), "the model folder's config.json (Hugging Face's format) is read"),
    ("enable_expert_parallel", None, bool, (False,), "no mixture-of-experts architecture is supported"),
    ("limit_mm_per_prompt", None, str, (None,), "the served models read text only"),
    (
        "chat_template_content_format",
        None,
        str,
        ("auto", "string"),
        "a message's content reaches the chat template as one string (its text parts joined)",
    ),
    (
        "prefix_caching_hash_algo",
        None,
        str,
        ("sha256",),
        "prefix-cache blocks are keyed by sha256 of their parent's key and their token ids",
    ),
]  # {name}: the option's spelling, a flag on the command line and a keyword in LLM()
# options accepted with any value: (type; bool for a switch, why they change nothing here)
ANY_VALUE: dict[str, tuple[type, str]] = {
    "trust_remote_code": (bool, "only raypaged's built-in architectures run; an unknown one is an error at startup"),
    "disable_log_stats": (bool, "raypaged logs no periodic stats (see /metrics)"),
    "disable_custom_all_reduce": (bool, "tensor-parallel all-reduces are NCCL's: there is no custom all-reduce kernel"),
    "max_seq_len_to_capture": (int, "decode CUDA graphs cover every context up to {max_model_len}"),
    "max_log_len": (int, "request log lines carry no prompt text"),
    "code_revision": (str, "no model code runs: only raypaged's built-in architectures"),
    "max_parallel_loading_workers": (int, "each shard reads its own share of the checkpoint, tensor by tensor"),
    "disable_sliding_window": (
        bool,
        "attention always spans the whole context: a model's sliding window caps {max_model_len}, as this flag asks",
    ),
}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_default_only(values: dict[str, object], as_flags: bool) -> None:
    """Refuse, by name (a flag or a keyword), an option of ``DEFAULT_ONLY`` set to another value."""
    for name, _, _, allowed, why in DEFAULT_ONLY:
        value = values.get(name, allowed[0])
        if value in allowed:
            continue
        why = explain(why, as_flags)
        if isinstance(value, bool) and as_flags:  # a switch: --name, or --no-name
            shown = flag(name) if value else f"--no-{flag(name)[2:]}"
        else:
            shown = f"{flag(name)} {value}" if as_flags else f"{name}={value!r}"
        raise ValueError(f"{shown} is not supported: {why}")


def explain(why: str, as_flags: bool) -> str:
    """``why`` with the options it names spelled as flags or as ``LLM`` keywords."""
    return why.format_map(_Spelling(as_flags))


class _Spelling(dict):
    def __init__(self, as_flags: bool) -> None:
        super().__init__()
        self.as_flags = as_flags

    def __missing__(self, name: str) -> str:
        return flag(name) if self.as_flags else name


def unknown_keyword(name: str, known: Iterable[str], also: Iterable[str] = ()) -> TypeError:
    """The error for an ``LLM`` keyword that is neither an engine field nor a vLLM option taken here: the closest
    of ``known`` (the engine's keywords) is suggested, else the closest of ``also`` (the vLLM options)."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    close = close or difflib.get_close_matches(name, list(also), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return TypeError(f"LLM got an unexpected keyword argument {name!r}{hint}")
