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
]  # {name}: the option's spelling, a flag on the command line and a keyword in LLM()
# options accepted with any value, and why they change nothing here
ANY_VALUE = {
    "trust_remote_code": "only raypaged's built-in architectures run; an unknown one is an error at startup",
    "disable_log_stats": "raypaged logs no periodic stats (see /metrics)",
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


def unknown_keyword(name: str, known: Iterable[str]) -> TypeError:
    """The error for an ``LLM`` keyword that is neither an engine field nor a vLLM option taken here."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return TypeError(f"LLM got an unexpected keyword argument {name!r}{hint}")
