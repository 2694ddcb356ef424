"""Engine configuration: validated at construction, with messages a user understands."""

from __future__ import annotations

import argparse
import builtins
import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raypaged import envs
from raypaged.human_int import human_int, human_int_or_auto
from raypaged.inputs.chat_format import CONTENT_FORMATS
from raypaged.inputs.limits import InputLimits
from raypaged.inputs.tokenizer import TOKENIZER_MODES, resolve_tokenizer_mode
from raypaged.model.default_model import DEFAULT_MODEL, default_model_dir
from raypaged.model.mistral_format import CONFIG_FORMATS
from raypaged.model.stages import stage_layers
from raypaged.pooling import (
    CONVERTS,
    RUNNERS,
    PoolerSettings,
    resolve_pooler,
    resolve_runner,
    set_classifier_tokens,
)
from raypaged.sampling_params import LOGPROBS_MODES, RAW_LOGPROBS, SamplingParams
from raypaged.spec_decode.config import SpeculativeConfig
from raypaged.structured.config import StructuredOutputsConfig
from raypaged.structured.reasoning import ReasoningConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from raypaged.lora.config import LoRAConfig
    from raypaged.quantization.base import QuantizationConfig

logger = logging.getLogger("raypaged")

_DTYPES = {
    "auto": "auto",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
# --kv-cache-dtype -> the cache's torch dtype (None: the model's); fp8 values are stored with scale 1.0
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
DEFAULT_CPU_KV_CACHE_SPACE_GIB = 4.0
DEFAULT_GPU_SWAP_SPACE_GIB = 4.0
# a step's default token budget: a GPU's step stays short at 8192 tokens, a CPU's would take seconds, and every running
# stream waits for it (on CPU the prefill GEMMs run at the same rate from a few hundred rows, so chunks cost nothing)
DEFAULT_STEP_TOKENS = {"cuda": 8192, "cpu": 512}
CPU_LONG_PROMPT_CHUNK = 128  # --long-prompt-chunk's default on CPU (with a budget above 256): a step of about 0.35 s
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD")
WAKE_TAGS = ("weights", "kv_cache")  # what sleep mode frees and wake_up(tags) brings back, in that order
SLEEP_MODE_OFF = "sleep mode is off: start the engine with --enable-sleep-mode (LLM(enable_sleep_mode=True))"


def check_sleep_level(level: object) -> None:
    """``ValueError`` for a sleep level other than vLLM's 1 and 2."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 (offload the weights) or 2 (discard them), got {level!r}")


def check_wake_tags(tags: Iterable[str]) -> None:
    """``ValueError`` for a ``wake_up`` tag other than ``WAKE_TAGS``."""
    for tag in tags:
        if tag not in WAKE_TAGS:
            raise ValueError(f"wake_up tags are 'weights' and 'kv_cache', got {tag!r}")


GENERATION_CONFIG_MODES = ("auto", "vllm")
# generation-config fields that become sampling defaults (max_new_tokens is SamplingParams' max_tokens)
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def resolve_model_path(
    model: str | None,
    revision: str | None = None,
    download_dir: str | None = None,
    what: str = "model",
    weights: bool = True,
    token: str | bool | None = None,
    formats: tuple[str, str] = ("auto", "auto"),
) -> Path:
    """A local folder for ``model``: a folder as given, a Hugging Face Hub id's cached snapshot (see
    ``model/hub.py``: ``what`` names the flag in its errors, ``weights=False`` fetches no weights, ``formats``
    (``--config-format``, ``--load-format``) pick the weights of a repository that holds two formats), a GGUF
    file's converted folder (a local file, or ``org/name:QUANT``: that repository's file of that type), or,
    for ``None`` or the default model's id without a revision or download folder, the bundled default model."""
    if model is None or (model == DEFAULT_MODEL and revision is None and download_dir is None):
        return default_model_dir()
    from raypaged.model.hub import is_gguf_hub_id, refuse_hub_options, resolve_gguf_hub_file, resolve_model_files

    if what == "model" and formats[1] in ("auto", "gguf") and is_gguf_hub_id(model):  # org/name:QUANT, as vLLM's
        from raypaged.model.gguf_checkpoint import gguf_model_dir

        return gguf_model_dir(resolve_gguf_hub_file(model, revision, download_dir, token))
    path = Path(model).expanduser()
    if formats[1] == "gguf" or (what == "model" and path.suffix == ".gguf" and path.is_file()):
        magic = b""
        if path.is_file():
            with path.open("rb") as file:
                magic = file.read(4)
        if magic != b"GGUF":  # every GGUF file's first bytes
            raise ValueError(f"--load-format gguf reads a local GGUF file, and model {model!r} is not one")
        refuse_hub_options(model, revision, download_dir, kind="a GGUF file")
        from raypaged.model.gguf_checkpoint import gguf_model_dir

        return gguf_model_dir(path)
    return resolve_model_files(model, revision, download_dir, what, weights, token, formats)


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """The checkpoint's recommended sampling values (``--generation-config``, then
    ``--override-generation-config``). They fill only what a request leaves unset; ``None``
    keeps ``SamplingParams``' own default. Invariant: together they make valid ``SamplingParams``."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # the generation config's max_new_tokens

    @classmethod
    def from_generation_config(cls, values: dict[str, Any]) -> GenerationDefaults:
        """The defaults among a generation config's fields; invalid values raise ``ValueError``."""
        chosen = {key: value for key, value in values.items() if key in GENERATION_DEFAULT_KEYS and value is not None}
        defaults = cls(**{("max_tokens" if key == "max_new_tokens" else key): value for key, value in chosen.items()})
        try:
            defaults.sampling_params()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the generation config's sampling defaults {chosen} are invalid: {exc}") from None
        return defaults

    def as_dict(self) -> dict[str, float | int]:
        """The defaults in force, by ``SamplingParams`` field name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with these defaults (vLLM's ``LLM.get_default_sampling_params``)."""
        keywords: dict[str, Any] = self.as_dict()  # by field name: each checked by SamplingParams itself
        return SamplingParams(**keywords)


CLI = "cli"  # the metadata key of an EngineConfig field's command-line flag


@dataclass(frozen=True, slots=True)
class CliFlag:
    """How an ``EngineConfig`` field is a command-line flag, ``--field-name`` (vLLM's spelling):
    ``entrypoints/cli.py`` adds the flag from it (``add_config_args``) and maps the parsed value back
    onto the field (``engine_kwargs``). The flag's default is the field's, or ``None`` ("not given")
    for a field with a default factory or ``unset``."""

    help: str | None = None
    aliases: tuple[str, ...] = ()  # option strings after --field-name (-tp, -q)
    type: Callable[[str], Any] | None = None  # argparse's type (int, float); None: the text itself
    nargs: str | None = None  # argparse's nargs ("+": one or more values, "?": an optional value)
    const: Any = None  # the value of a bare flag with nargs "?"
    choices: tuple[str, ...] | None = None
    # "store_true", argparse.BooleanOptionalAction (builtins.type: the field above is named type)
    action: str | builtins.type[argparse.Action] | None = None
    metavar: str | None = None
    unset: bool = False  # the flag's default is None: not given, the field keeps its own default
    # (flag, text) -> the field's value, for text that is more than a string (JSON); errors name the flag
    parse: Callable[[str, str], Any] | None = None


def _flag(
    default: Any = MISSING,
    help: str | None = None,
    *,
    default_factory: Any = MISSING,
    repr: bool = True,
    **cli: Any,
) -> Any:
    """An ``EngineConfig`` field that is a command-line flag (``CliFlag``'s arguments in ``cli``); ``repr`` False
    keeps a secret out of the config's repr."""
    return field(default=default, default_factory=default_factory, repr=repr, metadata={CLI: CliFlag(help=help, **cli)})


def cli_flag(f: Field) -> CliFlag | None:
    """The flag of an ``EngineConfig`` field, ``None`` for a field the command line sets otherwise."""
    return f.metadata.get(CLI)


# --mm-processor-kwargs' keys and their types, by family: Qwen-VL's pixel bounds, Gemma 3's pan-and-scan crops
PROCESSOR_KWARGS: dict[str, dict[str, type]] = {
    "Qwen2-VL, Qwen2.5-VL and Qwen3-VL": {"min_pixels": int, "max_pixels": int},
    "Gemma 3": {
        "do_pan_and_scan": bool,
        "pan_and_scan_min_crop_size": int,
        "pan_and_scan_max_num_crops": int,
        "pan_and_scan_min_ratio_to_activate": float,
    },
}


def check_processor_kwargs(image_config: PretrainedConfig | None, given: Any, name: str) -> None:
    """An image processor's options (``name``: the flag or the request field that gave them): the keys of the
    model's family (``PROCESSOR_KWARGS``), each of its type (whole numbers of 1 or more, Qwen-VL's least pixels not
    above its most); ``ValueError`` naming anything else."""
    from raypaged.model.architecture import processor_kwargs_family

    if not isinstance(given, dict):
        raise ValueError(f"{name} takes a JSON object, got {given!r}")
    if image_config is None:
        raise ValueError(f"{name} applies to image-text models: the model reads text only")
    allowed = PROCESSOR_KWARGS.get(processor_kwargs_family(image_config) or "", {})
    for key, value in given.items():
        if key not in allowed:
            supported = "; ".join(f"{', '.join(keys)} for {family}" for family, keys in PROCESSOR_KWARGS.items())
            raise ValueError(
                f"{name} {key!r} is not supported for {image_config.architectures[0]} (supported: {supported})"
            )
        kind = allowed[key]
        if kind is bool and type(value) is not bool:
            raise ValueError(f"{name} {key}: true or false, got {value!r}")
        if kind is int and (type(value) is not int or value < 1):
            raise ValueError(f"{name} {key}: a whole number of 1 or more, got {value!r}")
        if kind is float and (type(value) not in (int, float) or value <= 0):
            raise ValueError(f"{name} {key}: a number above 0, got {value!r}")
    if given.get("min_pixels", 0) > given.get("max_pixels", given.get("min_pixels", 0)):
        raise ValueError(f"{name} min_pixels {given['min_pixels']} is above max_pixels {given['max_pixels']}")


def json_flag_value(flag_name: str, value: str) -> Any:
    """A flag's JSON text, parsed; ``ValueError`` naming the flag."""
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag_name} takes a JSON object, got {value!r} ({exc})") from None


def _speculative_flag(flag_name: str, value: str | dict[str, Any]) -> SpeculativeConfig | None:
    return SpeculativeConfig.parse(value)  # its errors name --speculative-config


@dataclass
class EngineConfig:
    """Everything needed to start an engine. ``None`` fields are resolved from the model.

    Each init field is an ``LLM`` keyword of the same name and default, and (``CliFlag`` metadata)
    a command-line flag; ``model``, ``served_model_name`` and ``limits`` have flags of their own in
    ``entrypoints/cli.py``."""

    model: str | None = None  # a local folder or a Hugging Face Hub id (org/name)
    revision: str | None = _flag(None, "branch, tag or commit of a Hub id (default: main); not for local folders")
    download_dir: str | None = _flag(
        None, "Hugging Face cache folder for Hub ids (default: $HF_HUB_CACHE, ~/.cache/huggingface/hub)"
    )
    # Hub access token; True: the one `hf auth login` saved; None: $HF_TOKEN or that saved one, as huggingface_hub
    hf_token: str | bool | None = _flag(
        None,
        "Hugging Face token for Hub ids (a bare --hf-token: the one `hf auth login` saved; default: $HF_TOKEN)",
        repr=False,
        nargs="?",
        const=True,
        metavar="TOKEN",
    )
    # a tokenizer apart from the model's (a folder or Hub id) and its revision (default: --revision)
    tokenizer: str | None = _flag(
        None, "the tokenizer's folder or Hub id (default: the model's); its chat template too"
    )
    tokenizer_revision: str | None = _flag(None, "branch, tag or commit of --tokenizer (default: --revision)")
    # vLLM's --tokenizer-mode: hf (Hugging Face's tokenizer and chat template), mistral (mistral_common's Tekken
    # tokenizer and request encoding), auto (mistral where the folder has tekken.json and no Hugging Face tokenizer)
    tokenizer_mode: str = _flag(
        "auto",
        "hf: the Hugging Face tokenizer and chat template; mistral: Mistral's Tekken tokenizer (tekken.json) and "
        "mistral_common's conversation encoding; auto: mistral where the folder has tekken.json and no Hugging Face "
        "tokenizer",
        choices=TOKENIZER_MODES,
    )
    # the name clients use; a list gives the model several (vLLM's --served-model-name a b): the first
    # is its name, the others (``served_model_aliases``) reach it too
    served_model_name: str | list[str] | None = None
    dtype: str = _flag("auto", "auto, half, float16, bfloat16, float, float32")
    block_size: int = _flag(16, "tokens per KV-cache block", type=int)
    # -1 or "auto": the model's, lowered to what the KV cache holds for one sequence (vLLM's)
    max_model_len: int | str | None = _flag(
        None,
        "context length (default: the model's; auto or -1: the model's, or the most the KV cache holds for one "
        "sequence when that is less); 32k = 32,000, 32K = 32,768",
        type=human_int_or_auto,
    )
    max_num_seqs: int = _flag(256, "most sequences in one batch", type=int)
    max_num_batched_tokens: int | None = _flag(
        None,
        "token budget of one step (8k, 8K as --max-model-len); default 8192 on CUDA, 512 on CPU (a long prompt is "
        "prefilled in chunks, so running streams wait at most one chunk's step), at least --max-num-seqs, and "
        "max_model_len for a model that computes each prompt whole",
        type=human_int,
    )
    long_prefill_token_threshold: int = _flag(
        0,
        "most tokens one sequence computes in a step (0: the step's budget): a long prompt is prefilled in chunks of "
        "this size, leaving room in each step for the prompts behind it",
        type=human_int,
    )
    long_prompt_chunk: int | None = _flag(
        None,
        "most tokens a prompt with more than a step's budget left computes in a step (0: the budget's), so the "
        "requests arriving during its prefill share each step; shorter prompts are not cut; default 128 on CPU "
        "(with a budget above 256), 0 on CUDA",
        type=human_int,
    )
    kv_cache_space: float | None = _flag(
        None, "GiB of KV cache on CPU (default $RAYPAGED_CPU_KVCACHE_SPACE, or 4)", type=float
    )
    kv_cache_memory_bytes: int | None = _flag(
        None,
        "bytes of KV cache per shard, on a device or on CPU, in place of --gpu-memory-utilization's profiling "
        "(and of --kv-cache-space); 8G = 8 GiB, 8g = 8e9",
        type=human_int,
    )
    num_gpu_blocks_override: int | None = _flag(None, "exact number of KV blocks", type=int)
    seed: int = _flag(
        0,
        "engine-wide random seed: requests without their own seed draw from a generator seeded with it, so the "
        "same requests in the same order sample the same tokens on every run",
        type=int,
    )
    device: str = _flag("auto", choices=("auto", "cpu", "cuda"))
    enable_prefix_caching: bool = _flag(
        True,
        "reuse KV blocks of shared prompt prefixes (default: on)",
        action=argparse.BooleanOptionalAction,
        unset=True,
    )
    swap_space: float | None = _flag(
        None, "GiB of CPU memory for swapped-out KV blocks (default: 4 on CUDA, 0 on CPU)", type=float
    )
    scheduling_policy: str = _flag(
        "fcfs", "admission order: arrival, or request priority (lower first)", choices=("fcfs", "priority")
    )
    # None: swap groups sharing blocks when CPU blocks exist, else recompute
    preemption_mode: str | None = _flag(
        None, "what a preempted request's KV blocks do (default: the engine's choice)", choices=("swap", "recompute")
    )
    # shards (Ray actors) per model
    tensor_parallel_size: int = _flag(1, "GPUs (or CPU shards) per model", aliases=("-tp",), type=int)
    pipeline_parallel_size: int = _flag(
        1,
        "pipeline stages per model, each of --tensor-parallel-size shards holding a contiguous share of the layers "
        "(and their KV cache); a step's residual stream passes from stage to stage",
        aliases=("-pp",),
        type=int,
    )
    enable_expert_parallel: bool = _flag(
        False,
        "mixture-of-experts models: each shard holds num_experts / tensor_parallel_size whole experts instead of "
        "its share of every expert (attention stays sharded by heads); no effect on a model without experts",
        aliases=("-ep",),
        action="store_true",
    )
    # "auto", "ray://host:port", a GCS address; None: a local Ray when one is needed
    ray_address: str | None = _flag(
        None, "Ray cluster to join: auto, ray://host:port or host:port (default: a local one)"
    )
    # Ray placement group strategy of the shards
    placement_strategy: str = _flag(
        "STRICT_PACK",
        "Ray placement of the tensor-parallel shards: one node, or spread over nodes",
        choices=PLACEMENT_STRATEGIES,
    )
    enable_recovery: bool = _flag(
        True,
        "when a Ray shard dies, hangs or fails its step: restart the shard group and recompute the in-flight "
        "requests (default), or with --no-enable-recovery fail them all",
        action=argparse.BooleanOptionalAction,
    )
    gpu_memory_utilization: float = _flag(
        0.9,
        "fraction of GPU memory for weights, activations and KV cache",
        aliases=("--device-memory-utilization",),
        type=float,
    )
    enforce_eager: bool = _flag(
        False, "CUDA: run decode steps eagerly instead of replaying captured CUDA graphs", action="store_true"
    )
    enable_sleep_mode: bool = _flag(
        False,
        "allow sleep(level) and wake_up(tags) (LLM; /sleep and /wake_up over HTTP): asleep, the engine holds "
        "neither weights nor KV cache and steps nothing; requests wait, and those in flight are recomputed after",
        action="store_true",
    )
    enable_prompt_embeds: bool = _flag(
        False,
        "take prompts as embeddings (vLLM's prompt_embeds: a [num_tokens, hidden_size] float tensor; over HTTP "
        "base64 of its torch.save bytes), fed to the model in place of token embeddings",
        action="store_true",
    )
    logprobs_mode: str = _flag(
        RAW_LOGPROBS,
        "what the logprobs requests ask for hold: the model's log-probabilities (raw_logprobs) or logits "
        "(raw_logits), or those the token was drawn from, after penalties, bias, temperature, top-k, top-p and "
        "min-p (processed_logprobs, processed_logits); prompt logprobs and cumulative_logprob stay raw_logprobs",
        choices=LOGPROBS_MODES,
    )
    stream_interval: int = _flag(
        1,
        "streams send a sequence's first token, then every N new tokens, and its end (fewer, larger chunks: less "
        "host work per token)",
        type=int,
        metavar="N",
    )
    # None: decode graphs for batch sizes 1, 2, 4, 8, 16, ... --max-num-seqs; piecewise ones for 8 ... 512 tokens
    cudagraph_capture_sizes: list[int] | None = _flag(
        None,
        "CUDA: the step sizes recorded as graphs (decode: batch sizes up to --max-num-seqs; mixed steps: token "
        "counts); larger steps run eagerly (default: 1 2 4 8 16 24 ... --max-num-seqs, and 8 16 24 32 48 ... 512)",
        type=int,
        nargs="+",
        metavar="N",
    )
    max_cudagraph_capture_size: int | None = _flag(
        None, "CUDA: the default graph sizes cut at this one (larger steps run eagerly)", type=int, metavar="N"
    )
    # None: on where it helps and runs (CUDA, one shard, no speculative decoding), else off
    async_scheduling: bool | None = _flag(
        None,
        "schedule and prepare each step while the one before runs, so host work hides behind the device's; "
        "identical tokens either way (default: on on CUDA with one shard and no speculative decoding)",
        action=argparse.BooleanOptionalAction,
        unset=True,
    )
    # auto (CUDA kernels where they run, the CPU decode kernel on CPU, else torch), torch, cpu, cuda
    attention_backend: str = _flag(
        "auto",
        "paged attention: the CUDA kernels on a GPU and the C decode kernel on CPU where they run (auto), or torch",
        choices=("auto", "torch", "cpu", "cuda"),
    )
    # auto: the folder's safetensors; dummy: random weights (benchmarks, no checkpoint)
    load_format: str = _flag(
        "auto",
        "dummy: random weights of the model folder's shape (benchmarks; no checkpoint read); mistral: the folder's "
        "consolidated*.safetensors in Mistral's names (auto reads them when the config is params.json); gguf: the "
        "model is a llama.cpp GGUF file, converted once (auto does the same for a path ending .gguf)",
        choices=("auto", "dummy", "mistral", "gguf"),
    )
    # vLLM's --config-format: hf reads config.json, mistral params.json, auto config.json if the folder has one,
    # else params.json
    config_format: str = _flag(
        "auto",
        "the model's config: hf (config.json), mistral (params.json, Mistral's own format), or auto: config.json "
        "if the folder has one, else params.json",
        choices=CONFIG_FORMATS,
    )
    # vLLM's --quantization: the checkpoint's quantization_config decides (this may only repeat it); on a
    # float checkpoint, fp8 quantizes at load
    quantization: str | None = _flag(
        None,
        "weights quantization: awq, compressed-tensors, fp8, gptq (default: the checkpoint's "
        "quantization_config; fp8 on a float checkpoint quantizes it at load)",
        aliases=("-q",),
        metavar="METHOD",
    )
    # auto (the model's dtype), fp8 / fp8_e4m3, fp8_e5m2: one byte per element
    kv_cache_dtype: str = _flag(
        "auto",
        "KV cache element type: auto (the model's dtype) or fp8 (one byte; K/V divided by each layer's scales: the "
        "checkpoint's, --calculate-kv-scales, or 1.0; on CUDA attention in torch unless RAYPAGED_FP8_KV_KERNELS=1)",
        choices=tuple(KV_CACHE_DTYPES),
    )
    calculate_kv_scales: bool = _flag(
        False,
        "fp8 KV cache: each layer's K and V scales from the first step's keys and values (max |k| / 200, "
        "max |v| / 100), in place of the checkpoint's or 1.0",
        action="store_true",
    )
    # vLLM's --runner / --convert / --pooler-config: an embedding model pools its prompts' final hidden states
    runner: str = _flag(
        "auto",
        "generate: a language model; pooling: an embedding model or a classifier (/v1/embeddings, /classify, /score, "
        "/rerank, LLM.embed, LLM.classify); auto: pooling for a checkpoint without a language-model head "
        "(Qwen3Model, *ForSequenceClassification, ...) or with --convert embed or classify",
        choices=RUNNERS,
    )
    convert: str = _flag(
        "auto",
        "embed: serve a generative checkpoint as an embedding model (its final hidden states pooled); classify: "
        "serve a *ForSequenceClassification checkpoint's head; auto: as the checkpoint is, embed under --runner "
        "pooling for a generative one",
        choices=CONVERTS,
    )
    pooler_config: dict[str, Any] | None = _flag(
        None,
        'embedding models: JSON object over the model\'s pooling, e.g. \'{"pooling_type": "MEAN", '
        '"normalize": false}\' (pooling_type LAST, MEAN or CLS; normalize; dimensions, matryoshka models only); '
        "default: the folder's sentence-transformers modules, else LAST and normalized",
        metavar="JSON",
        parse=json_flag_value,
    )
    limits: InputLimits = field(default_factory=InputLimits)  # per-request caps (--max-logprobs ...)
    # auto: the model folder's generation_config.json; vllm: no defaults; a folder
    generation_config: str = _flag(
        "auto",
        "sampling defaults and extra EOS ids: auto (the model folder's generation_config.json), vllm (no "
        "sampling defaults) or a folder holding a generation_config.json",
    )
    limit_mm_per_prompt: dict[str, Any] | None = _flag(
        None,
        'images a prompt may carry, as vLLM\'s JSON: \'{"image": 2}\' (or {"image": {"count": 2}}); 0 serves an '
        "image-text model's text only; other modalities are taken at 0 only (default: any number of images)",
        metavar="JSON",
        parse=json_flag_value,
    )
    mm_processor_kwargs: dict[str, Any] | None = _flag(
        None,
        "the image processor's options, as vLLM's JSON: Qwen-VL's '{\"min_pixels\": N, \"max_pixels\": M}' (the "
        "pixels an image is resized to stay between), Gemma 3's '{\"do_pan_and_scan\": true}' (and its "
        "pan_and_scan_* options: crops of a wide or tall image beside it); default: the checkpoint's",
        metavar="JSON",
        parse=json_flag_value,
    )
    allowed_local_media_path: str | None = _flag(
        None, "requests' image URLs may be file:// URLs of files under this folder (default: none)", metavar="PATH"
    )
    allowed_media_domains: list[str] | None = _flag(
        None, "requests' http(s) image URLs only to these host names (default: any)", nargs="+", metavar="HOST"
    )
    # vLLM's --hf-config-path: the config of another folder or Hub id (the original model's, for a GGUF file)
    hf_config_path: str | None = _flag(
        None,
        "folder or Hugging Face Hub id whose config (config.json, or params.json with --config-format mistral) is "
        "read in place of the model's: the original model's, for a GGUF file (default: the model's own)",
        metavar="PATH",
    )
    hf_overrides: dict[str, Any] | None = _flag(
        None,
        "JSON object read as if it were in the model's config.json, e.g. '{\"max_position_embeddings\": 4096}' "
        "(an object merges into the one it names, key by key)",
        parse=json_flag_value,
    )
    override_generation_config: dict[str, Any] | None = _flag(
        None,
        "JSON object of sampling defaults over the generation config's, e.g. '{\"temperature\": 0.5}' "
        "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens)",
        parse=json_flag_value,
    )
    # grammar engine of structured outputs (--structured-outputs-config; cli.py also reads
    # --guided-decoding-backend and --reasoning-parser into it)
    structured_outputs_config: StructuredOutputsConfig | dict[str, Any] = _flag(
        help='structured outputs as vLLM\'s: \'{"backend": "xgrammar", "disable_any_whitespace": true, '
        '"max_whitespace": 4, "cache_size": 256, "cache_mb": 512}\' (backend xgrammar or auto)',
        default_factory=StructuredOutputsConfig,
        metavar="JSON",
    )
    reasoning_config: ReasoningConfig | dict[str, str] | str | None = _flag(
        None,
        "where a reasoning section opens and closes, for requests' thinking_token_budget, as vLLM's: "
        '\'{"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}\' (either left out: '
        "--reasoning-parser's, <think> and </think>)",
        metavar="JSON",
    )
    chat_template: str | None = _flag(
        None,
        "a Jinja chat template (a file, or the template itself) over the tokenizer's",
        metavar="FILE_OR_TEMPLATE",
    )
    # vLLM's --chat-template-content-format: how a message's content reaches the template
    chat_template_content_format: str = _flag(
        "auto",
        "string: a message's content is one string (its text parts joined by newlines); openai: a list of parts, "
        'as OpenAI\'s API ([{"type": "text", "text": ...}]); auto: openai where the template loops over a '
        "message's content, string otherwise",
        choices=CONTENT_FORMATS,
    )
    default_chat_template_kwargs: dict[str, Any] | None = _flag(
        None,
        "template variables every chat request gets, e.g. '{\"enable_thinking\": false}'",
        metavar="JSON",
        parse=json_flag_value,
    )
    trust_request_chat_template: bool = _flag(
        False, "a chat request may bring its own chat_template (refused otherwise)", action="store_true"
    )
    # LoRA (vLLM's --enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras): adapters a request may run on
    enable_lora: bool = _flag(
        False,
        "serve LoRA adapters (PEFT folders) on the model: --lora-modules, or loaded at runtime",
        action="store_true",
    )
    max_loras: int = _flag(1, "LoRA adapters in device slots at once; requests of others wait for a slot", type=int)
    max_lora_rank: int = _flag(16, "the highest LoRA rank an adapter may have", type=int)
    max_cpu_loras: int | None = _flag(
        None, "LoRA adapters kept loaded on the CPU behind the device slots (default: --max-loras)", type=int
    )
    # speculative decoding (vLLM's --speculative-config): ngram or a draft model's proposals, verified exactly
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = _flag(
        None,
        'speculative decoding as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4}\' (also disable_by_batch_size)',
        aliases=("-sc",),
        metavar="JSON",
        parse=_speculative_flag,
    )
    # vLLM's cap on the running batch below --max-num-seqs (which still sizes the CUDA graphs and buffers)
    max_num_active_seqs: int | None = _flag(
        None, "most sequences in the running batch, at most --max-num-seqs (default: --max-num-seqs)", type=int
    )
    # admission limits of a server's engine (vLLM's): a request over one is refused with 503, to be sent elsewhere
    max_num_queued_reqs: int | None = _flag(
        None,
        "serve: a request is refused with 503 when its sequences (n) and the engine's unfinished ones would be "
        "more than this (default: no limit)",
        type=int,
    )
    max_num_queued_tokens: int | None = _flag(
        None,
        "serve: a request is refused with 503 while the engine's requests not yet past their prefill hold this "
        "many prompt tokens (default: no limit; 8k, 8K as --max-model-len)",
        type=human_int,
    )
    # Prometheus bucket bounds by vLLM's family name (serving/buckets.py), over the defaults
    custom_histogram_buckets: dict[str, list[float]] | None = _flag(
        None,
        "JSON object of histogram bucket bounds by family, e.g. '{\"time_to_first_token\": [0.1, 0.5, 1]}' "
        "(request_latency, time_to_first_token, inter_token_latency, iteration_tokens, request_params_n, "
        "request_tokens)",
        metavar="JSON",
        parse=json_flag_value,
    )
    served_model_aliases: tuple[str, ...] = field(init=False, default=())
    fit_max_model_len: bool = field(init=False, default=False)  # max_model_len auto: lowered to the KV cache's
    chat_template_text: str | None = field(init=False, default=None)  # --chat-template's text
    model_path: Path = field(init=False)
    tokenizer_path: Path = field(init=False)
    resolved_tokenizer_mode: str = field(init=False, default="hf")  # tokenizer_mode, auto resolved: hf or mistral
    hf_config: PretrainedConfig = field(init=False, repr=False)
    generation_defaults: GenerationDefaults = field(init=False)
    generation_eos_token_ids: tuple[int, ...] = field(init=False)  # the generation config's eos_token_id
    quant_config: QuantizationConfig | None = field(init=False, default=None, repr=False)  # resolved --quantization
    draft_model_path: Path | None = field(init=False, default=None)  # the speculative draft model's folder
    draft_hf_config: PretrainedConfig | None = field(init=False, default=None, repr=False)
    # an image-text checkpoint whose images are read (architecture.IMAGE_WRAPPERS): its whole config, else None
    image_hf_config: PretrainedConfig | None = field(init=False, default=None, repr=False)
    images_per_prompt: int | None = field(init=False, default=None)  # limit_mm_per_prompt's image count
    pooler: PoolerSettings | None = field(init=False, default=None)  # set exactly when the engine pools (--runner)
    encoder: bool = field(init=False, default=False)  # BERT, RoBERTa, XLM-R: prompts computed whole, no KV cache
    # every token attends to its whole prompt (an encoder, or a decoder with use_bidirectional_attention, as
    # EmbeddingGemma): a prompt is computed whole in one step, and nothing is generated
    whole_prompts: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.speculative_config = spec = SpeculativeConfig.parse(self.speculative_config)
        if not isinstance(self.structured_outputs_config, StructuredOutputsConfig):  # vLLM's dict form
            self.structured_outputs_config = StructuredOutputsConfig.parse(self.structured_outputs_config)
        self.reasoning_config = ReasoningConfig.parse(self.reasoning_config)
        self.chat_template_text = _chat_template_text(self.chat_template)
        if self.default_chat_template_kwargs is not None and not isinstance(self.default_chat_template_kwargs, dict):
            raise ValueError(
                f"--default-chat-template-kwargs must be a JSON object, got {self.default_chat_template_kwargs!r}"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.block_size not in _BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {_BLOCK_SIZES}, got {self.block_size}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.kv_cache_space is not None and self.kv_cache_space <= 0:
            raise ValueError(f"kv_cache_space must be a positive number of GiB, got {self.kv_cache_space}")
        if self.kv_cache_memory_bytes is not None:
            if self.kv_cache_memory_bytes <= 0:
                raise ValueError(f"kv_cache_memory_bytes must be a positive number, got {self.kv_cache_memory_bytes}")
            for other in ("kv_cache_space", "num_gpu_blocks_override"):
                if getattr(self, other) is not None:
                    raise ValueError(f"give one of kv_cache_memory_bytes and {other}: both size the KV cache")
        if self.swap_space is not None and self.swap_space < 0:
            raise ValueError(f"swap_space must be a non-negative number of GiB, got {self.swap_space}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be at least 1, got {self.num_gpu_blocks_override}")
        if self.attention_backend not in ("auto", "torch", "cpu", "cuda"):
            raise ValueError(f"attention_backend must be auto, torch, cpu or cuda, got {self.attention_backend!r}")
        if self.load_format not in ("auto", "dummy", "mistral", "gguf"):
            raise ValueError(f"load_format must be auto, dummy, mistral or gguf, got {self.load_format!r}")
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(
                f"--tokenizer-mode {self.tokenizer_mode} is not supported: hf (the Hugging Face tokenizer), mistral "
                "(Mistral's tokenizer) or auto"
            )
        if self.config_format not in CONFIG_FORMATS:
            raise ValueError(f"config_format must be one of {', '.join(CONFIG_FORMATS)}, got {self.config_format!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        e4m3_kernels = self.kv_cache_dtype in ("fp8", "fp8_e4m3") and envs.fp8_kv_kernels()
        if self.kv_cache_dtype != "auto" and self.attention_backend == "cuda" and not e4m3_kernels:
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype} runs in the torch attention backend: "
                "--attention-backend cuda reads a cache of the model's dtype (and an fp8 e4m3 one with "
                "RAYPAGED_FP8_KV_KERNELS=1)"
            )
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError(
                "--calculate-kv-scales sets an fp8 KV cache's scales: it needs --kv-cache-dtype fp8 "
                "(the cache is the model's dtype, which takes no scales)"
            )
        if self.kv_cache_dtype == "fp8_e5m2" and self.attention_backend == "cpu":
            raise ValueError(
                "--kv-cache-dtype fp8_e5m2 runs in the torch attention backend: --attention-backend "
                "cpu reads float32 and fp8 e4m3 caches (--kv-cache-dtype fp8 or fp8_e4m3)"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be at least 1, got {self.pipeline_parallel_size}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {self.placement_strategy!r}"
            )
        self._check_generation_config_args()
        self._check_async_scheduling()
        self._check_admission_limits()
        _ = self.lora_config  # the LoRA flags are checked now
        from transformers import AutoConfig  # importing this module loads neither transformers nor torch

        from raypaged.model.architecture import check_options
        from raypaged.model.encoder import check_encoder_options, is_encoder
        from raypaged.model.llama import check_tensor_parallel

        self.model_path = resolve_model_path(
            self.model,
            self.revision,
            self.download_dir,
            token=self.hf_token,
            formats=(self.config_format, "auto" if self.load_format == "dummy" else self.load_format),
        )
        self.tokenizer_path = self._resolve_tokenizer_path()
        self.resolved_tokenizer_mode = resolve_tokenizer_mode(self.tokenizer_mode, self.tokenizer_path)
        if self.resolved_tokenizer_mode == "mistral" and self.chat_template is not None:
            raise ValueError(
                "--chat-template does not apply with Mistral's tokenizer (--tokenizer-mode mistral): mistral_common "
                "encodes conversations itself"
            )
        from raypaged.model.architecture import image_model_config, language_model_config
        from raypaged.model.mistral_format import mistral_config, reads_mistral_config

        config_dir = self._resolve_hf_config_dir()
        if reads_mistral_config(config_dir, self.config_format):  # params.json (vLLM's --config-format mistral)
            whole = mistral_config(config_dir)
            if self.hf_overrides:
                whole = overridden_hf_config(config_dir, self.hf_overrides, whole.to_dict())
        elif self.hf_overrides:
            whole = overridden_hf_config(config_dir, self.hf_overrides)
        else:
            whole = AutoConfig.from_pretrained(config_dir)
        self.image_hf_config = image_model_config(whole)
        self.hf_config = language_model_config(whole)
        if self.image_hf_config is not None:
            logger.info(
                "%s: serving its language model with its vision tower (images)", self.hf_config.raypaged_multimodal
            )
        elif (wrapper := getattr(self.hf_config, "raypaged_multimodal", None)) is not None:
            logger.info(
                "%s: serving its language model (%s) for text; its vision tower is not loaded, and a request with "
                "an image is refused",
                wrapper,
                self.hf_config.architectures[0],
            )
        self.generation_defaults, self.generation_eos_token_ids = self._read_generation_config()
        self.encoder = is_encoder(self.hf_config)
        self.whole_prompts = self.encoder or bool(getattr(self.hf_config, "use_bidirectional_attention", False))
        check_architecture(self.hf_config, "model")
        self._resolve_runner()
        self.quant_config = self._resolve_quantization()
        if self.encoder:
            check_encoder_options(
                self.hf_config,
                self.tensor_parallel_size,
                self.quant_config is not None,
                self.enable_lora,
                self.attention_backend,
            )
            if self.kv_cache_dtype != "auto" or self.calculate_kv_scales:
                raise ValueError(
                    "--kv-cache-dtype and --calculate-kv-scales do not apply to an encoder: it keeps no KV cache"
                )
        else:
            check_tensor_parallel(self.hf_config, self.tensor_parallel_size, self.enable_expert_parallel)
            check_options(self.hf_config, self.quant_config is not None, self.enable_lora, self.attention_backend)
        self.max_model_len = self._resolve_max_model_len()
        self._resolve_draft_model(spec)
        if self.max_num_batched_tokens is None:
            whole = self.max_model_len if self.whole_prompts else 0
            self.max_num_batched_tokens = max(DEFAULT_STEP_TOKENS[self.resolved_device], self.max_num_seqs, whole)
        if self.whole_prompts and self.max_num_batched_tokens < self.max_model_len:
            what = "an encoder" if self.encoder else "a model of bidirectional attention"
            raise ValueError(
                f"--max-num-batched-tokens {self.max_num_batched_tokens} is below max_model_len {self.max_model_len}: "
                f"{what} computes each prompt whole, in one step (raise it, or lower --max-model-len)"
            )
        _ = self.cuda_graph_sizes  # the graph-size flags are checked now
        self.images_per_prompt = self._resolve_image_limit()
        self._check_whole_images()
        self._check_processor_kwargs()
        self._check_prompt_embeds()
        self._check_pipeline_parallel()
        if self.long_prompt_chunk is None:
            # on CPU a 512-token chunk is a 1.3 s step, and a prompt longer than the budget took every step's budget:
            # a request arriving during a 6,000-token prefill waited 19 s for it; chunks of 128 cost that prompt nothing
            cpu = self.resolved_device == "cpu" and not self.whole_prompts
            self.long_prompt_chunk = CPU_LONG_PROMPT_CHUNK if cpu and self.max_num_batched_tokens > 256 else 0
        if self.long_prompt_chunk < 0:
            raise ValueError(f"--long-prompt-chunk must be 0 or more, got {self.long_prompt_chunk}")
        if self.long_prompt_chunk and self.whole_prompts:
            raise ValueError("--long-prompt-chunk does not apply: the model computes each prompt whole, in one step")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"--long-prefill-token-threshold must be 0 or more, got {self.long_prefill_token_threshold}"
            )
        if self.long_prefill_token_threshold and self.whole_prompts:
            raise ValueError(
                "--long-prefill-token-threshold does not apply: the model computes each prompt whole, in one step"
            )
        if isinstance(self.served_model_name, (list, tuple)):
            names = [str(n) for n in self.served_model_name]
            if not names or not all(names) or len(set(names)) != len(names):
                raise ValueError(f"served_model_name must be distinct, non-empty names, got {names}")
            self.served_model_name, self.served_model_aliases = names[0], tuple(names[1:])
        if self.served_model_name is None:
            self.served_model_name = DEFAULT_MODEL if self.model is None else self.model

    def _resolve_image_limit(self) -> int | None:
        """``limit_mm_per_prompt``'s image count (None: no limit); any other modality only at 0, and images only
        where the model reads them."""
        given = self.limit_mm_per_prompt
        if given is None:
            return None
        if isinstance(given, str):
            given = json_flag_value("--limit-mm-per-prompt", given)
        if not isinstance(given, dict):
            raise ValueError(f"--limit-mm-per-prompt takes a JSON object of modalities, got {given!r}")
        counts = {}
        for modality, limit in given.items():
            count = limit.get("count") if isinstance(limit, dict) else limit
            if type(count) is not int or count < 0:
                raise ValueError(f"--limit-mm-per-prompt {modality}: a count of 0 or more, got {limit!r}")
            counts[modality] = count
        other = next((m for m, count in counts.items() if m != "image" and count), None)
        if other is not None:
            raise ValueError(
                f"--limit-mm-per-prompt {other}: {counts[other]} is not supported: models read images only"
            )
        if counts.get("image") and self.image_hf_config is None:
            raise ValueError(
                f"--limit-mm-per-prompt image: {counts['image']} is not supported: the model reads text only"
            )
        return counts.get("image")

    def _check_pipeline_parallel(self) -> None:
        """``--pipeline-parallel-size``: at least one layer a stage, and nothing that needs every layer on one shard."""
        stages = self.pipeline_parallel_size
        if stages == 1:
            return
        num_layers = self.hf_config.num_hidden_layers
        why = None
        if num_layers < stages:
            why = f"the model has {num_layers} layers, fewer than the stages"
        elif self.pooler is not None or self.encoder:
            why = "an embedding model or an encoder runs whole on each shard"
        elif (deepstack := self._deepstack_layers()) > (first := len(stage_layers(num_layers, stages)[0])):
            why = (
                f"the vision tower's DeepStack features feed the first {deepstack} layers, and the first stage "
                f"holds {first}"
            )
        elif (spec := self.parsed_speculative_config) is not None and spec.method == "draft_model":
            why = "a draft model runs beside the whole model on one shard (n-gram speculation runs at any size)"
        if why is not None:
            raise ValueError(f"--pipeline-parallel-size {stages} is not supported: {why}")

    def _deepstack_layers(self) -> int:
        """Qwen3-VL: the language layers its vision tower's DeepStack features are added to (the first ones)."""
        vision = getattr(self.image_hf_config, "vision_config", None)
        return len(getattr(vision, "deepstack_visual_indexes", None) or ())

    def _check_prompt_embeds(self) -> None:
        """``--enable-prompt-embeds``: a generative text model that takes its input embeddings as they are."""
        if not self.enable_prompt_embeds:
            return
        from raypaged.model.architecture import architecture_of

        why = None
        if self.pooler is not None:
            why = "the engine pools, it does not generate"
        elif self.image_hf_config is not None:
            why = "an image-text model's prompts are text and images"
        elif self.parsed_speculative_config is not None:
            why = "speculative decoding proposes drafts from the prompt's token ids"
        elif architecture_of(self.hf_config).embedding_multiplier != 1.0:
            why = "the model scales its input embeddings"
        if why is not None:
            name = (self.hf_config.architectures or [self.hf_config.model_type])[0]
            raise ValueError(f"--enable-prompt-embeds is not supported for {name}: {why}")

    def _check_processor_kwargs(self) -> None:
        """``--mm-processor-kwargs``: ``check_processor_kwargs``'s."""
        if self.mm_processor_kwargs:
            check_processor_kwargs(self.image_hf_config, self.mm_processor_kwargs, "--mm-processor-kwargs")

    def _check_whole_images(self) -> None:
        """Gemma 3 computes each image's tokens in one step: the step's token budget must hold one image."""
        from raypaged.model.architecture import attends_images_both_ways

        image_config = self.image_hf_config
        if image_config is None or self.images_per_prompt == 0 or not attends_images_both_ways(image_config):
            return
        per_image = int(image_config.mm_tokens_per_image)
        if self.resolved_max_num_batched_tokens < per_image:
            raise ValueError(
                f"--max-num-batched-tokens {self.max_num_batched_tokens} is below the {per_image} tokens of one "
                f"image: {image_config.architectures[0]} computes an image's tokens in one step (raise it, or serve "
                "text only with --limit-mm-per-prompt '{\"image\": 0}')"
            )

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name the model answers to, its own first."""
        name = self.served_model_name
        assert isinstance(name, str), "__post_init__ resolves served_model_name to one name"
        return (name, *self.served_model_aliases)

    # The fields below are resolved or parsed by __post_init__. Their declared types keep what a caller may pass
    # (LLM's signature copies them); the engine reads the resolved values through these.

    @property
    def resolved_max_model_len(self) -> int:
        """``max_model_len``: the one given, or the model's (with ``auto``, as the KV cache allows)."""
        assert isinstance(self.max_model_len, int), "__post_init__ resolves max_model_len"
        return self.max_model_len

    @property
    def resolved_long_prompt_chunk(self) -> int:
        assert self.long_prompt_chunk is not None, "__post_init__ resolves long_prompt_chunk"
        return self.long_prompt_chunk

    @property
    def resolved_max_num_batched_tokens(self) -> int:
        assert self.max_num_batched_tokens is not None, "__post_init__ resolves max_num_batched_tokens"
        return self.max_num_batched_tokens

    @property
    def cuda_graph_sizes(self) -> tuple[list[int], list[int]]:
        """The decode graphs' batch sizes and the piecewise graphs' token counts (``graph_sizes.capture_sizes``)."""
        from raypaged.worker.graph_sizes import capture_sizes

        return capture_sizes(
            self.max_num_seqs,
            self.resolved_max_num_batched_tokens,
            self.cudagraph_capture_sizes,
            self.max_cudagraph_capture_size,
        )

    @property
    def parsed_speculative_config(self) -> SpeculativeConfig | None:
        spec = self.speculative_config
        assert spec is None or isinstance(spec, SpeculativeConfig), "__post_init__ parses speculative_config"
        return spec

    @property
    def parsed_structured_outputs_config(self) -> StructuredOutputsConfig:
        structured = self.structured_outputs_config
        assert isinstance(structured, StructuredOutputsConfig), "__post_init__ parses structured_outputs_config"
        return structured

    def config_hash(self) -> str:
        """8 hex digits of a SHA-256 of every setting a flag sets (secrets left out) and the resolved
        device and dtype: equal for two engines set up alike, across restarts (vLLM's ``compute_hash``)."""
        settings = {f.name: getattr(self, f.name) for f in fields(self) if cli_flag(f) is not None and f.repr}
        settings["resolved"] = (self.resolved_device, self.resolved_dtype)
        text = json.dumps(settings, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    @property
    def reasoning_delimiters(self) -> tuple[str, str] | None:
        """(start, end) of a reasoning section, from ``--reasoning-config`` and ``--reasoning-parser``;
        ``None``: neither is given, and a ``thinking_token_budget`` is refused."""
        config = self.reasoning_config
        assert config is None or isinstance(config, ReasoningConfig), "__post_init__ parses reasoning_config"
        return (config or ReasoningConfig()).delimiters(self.parsed_structured_outputs_config.reasoning_parser)

    def _resolve_hf_config_dir(self) -> Path:
        """The folder whose config is the model's: ``hf_config_path``'s (a folder, or a Hub id's snapshot of its
        config and tokenizer files at ``revision``), else the model's own."""
        if self.hf_config_path is None:
            return self.model_path
        local = Path(self.hf_config_path).expanduser().exists()
        path = resolve_model_path(
            self.hf_config_path,
            None if local else self.revision,
            None if local else self.download_dir,
            what="--hf-config-path",
            weights=False,
            token=self.hf_token,
        )
        logger.info("config of %s: %s's", self.model, self.hf_config_path)
        return path

    def _resolve_tokenizer_path(self) -> Path:
        """The tokenizer's folder: the model's unless ``tokenizer``/``tokenizer_revision`` name another
        (a folder or a Hub id, whose tokenizer files alone are fetched), as vLLM's ``--tokenizer``."""
        if self.tokenizer is None and self.tokenizer_revision is None:
            from raypaged.model.gguf_checkpoint import TOKENIZER_ERROR

            if (self.model_path / TOKENIZER_ERROR).is_file():
                raise ValueError(
                    f"transformers cannot read the tokenizer of GGUF file {self.model!r} "
                    f"({(self.model_path / TOKENIZER_ERROR).read_text()}): name the original model's with --tokenizer "
                    "(a folder or a Hub id)"
                )
            return self.model_path
        name = self.model if self.tokenizer is None else self.tokenizer
        revision = self.revision if self.tokenizer_revision is None else self.tokenizer_revision
        path = resolve_model_path(
            name, revision, self.download_dir, what="tokenizer", weights=False, token=self.hf_token
        )
        if path.resolve() != self.model_path.resolve():
            at = f" at revision {revision}" if revision is not None else ""
            logger.info("tokenizer %s%s: %s", name, at, path)
        return path

    def _check_generation_config_args(self) -> None:
        mode = self.generation_config
        if mode not in GENERATION_CONFIG_MODES and not Path(mode).expanduser().is_dir():
            raise ValueError(
                f"--generation-config must be auto, vllm or a folder holding generation_config.json, got {mode!r}"
            )
        override = self.override_generation_config
        if override is None:
            return
        if not isinstance(override, dict):
            raise ValueError(f"--override-generation-config must be a JSON object, got {override!r}")
        unknown = [key for key in override if key not in GENERATION_DEFAULT_KEYS]
        if unknown:
            raise ValueError(
                f"--override-generation-config: unknown field {unknown[0]!r}; "
                f"allowed: {', '.join(GENERATION_DEFAULT_KEYS)}"
            )

    def _read_generation_config(self) -> tuple[GenerationDefaults, tuple[int, ...]]:
        """(sampling defaults, EOS ids) as vLLM reads them: ``auto`` and ``vllm`` read the model
        folder's generation_config.json (a missing one is empty), ``vllm`` keeping only its EOS ids;
        a folder's must be there. The override adds to or replaces the defaults in every mode."""
        from transformers import GenerationConfig

        mode = self.generation_config
        folder = self.model_path if mode in GENERATION_CONFIG_MODES else Path(mode).expanduser()
        path = folder / "generation_config.json"
        values: dict[str, Any] = {}
        if path.is_file():
            try:
                values = GenerationConfig.from_pretrained(folder).to_diff_dict()
            except OSError as exc:
                raise ValueError(f"{path} cannot be read: {exc}") from None
        elif mode not in GENERATION_CONFIG_MODES:
            raise ValueError(f"--generation-config {mode!r} holds no generation_config.json")
        eos = values.get("eos_token_id")
        eos_ids = () if eos is None else tuple([eos] if isinstance(eos, int) else eos)
        sampling = {} if mode == "vllm" else values
        defaults = GenerationDefaults.from_generation_config({**sampling, **(self.override_generation_config or {})})
        return defaults, eos_ids

    @property
    def lora_config(self) -> LoRAConfig | None:
        """The LoRA settings (``None`` without ``enable_lora``); invalid flags raise ``ValueError``."""
        if not self.enable_lora:
            return None
        from raypaged.lora.config import LoRAConfig

        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def _resolve_quantization(self) -> QuantizationConfig | None:
        from raypaged.quantization import resolve_quantization

        checkpoint = getattr(self.hf_config, "quantization_config", None)
        if checkpoint is not None and not isinstance(checkpoint, dict):
            checkpoint = checkpoint.to_dict()
        mxfp4 = checkpoint is not None and checkpoint.get("quant_method") == "mxfp4"
        if self.quantization == "mxfp4" or mxfp4:
            if not (mxfp4 and self.hf_config.model_type == "gpt_oss"):
                raise ValueError(
                    "mxfp4 is read from gpt-oss checkpoints only (quant_method mxfp4, their experts' weights): "
                    f"this checkpoint's is {None if checkpoint is None else checkpoint.get('quant_method')!r} "
                    f"({self.hf_config.architectures})"
                )
            if self.quantization not in (None, "mxfp4"):
                raise ValueError(
                    f"--quantization {self.quantization} contradicts the checkpoint's quantization_config "
                    "(quant_method 'mxfp4'): drop --quantization or pass --quantization mxfp4"
                )
            logger.info(
                "gpt-oss MXFP4 experts: dequantized at load to %s (no MXFP4 GEMMs: the experts take 4x their "
                "checkpoint's memory in bf16)",
                self.resolved_dtype,
            )
            return None
        quant_config = resolve_quantization(self.quantization, checkpoint)
        if quant_config is not None and self.load_format == "dummy" and checkpoint is not None:
            raise ValueError(
                f"--load-format dummy cannot fill the {quant_config.name} tensors of a quantized "
                "checkpoint (use --load-format auto, or a float model folder with --quantization fp8)"
            )
        return quant_config

    def _resolve_draft_model(self, spec: SpeculativeConfig | None) -> None:
        """The draft model's folder and config (``spec``: the parsed ``speculative_config``): a supported
        architecture with the target's vocabulary, on one shard, long enough for ``max_model_len``."""
        if spec is None or spec.method != "draft_model":
            return
        from transformers import AutoConfig

        if self.tensor_parallel_size > 1:
            raise ValueError(
                "--speculative-config draft_model runs on one shard: tensor_parallel_size must be 1 "
                "(method ngram works under tensor parallelism)"
            )
        self.draft_model_path = resolve_model_path(
            spec.model, None, self.download_dir, what="draft model", token=self.hf_token
        )
        self.draft_hf_config = draft = AutoConfig.from_pretrained(self.draft_model_path)
        check_architecture(draft, "draft model")
        from raypaged.model.encoder import is_encoder

        if is_encoder(draft):
            raise ValueError(f"the draft model {spec.model} is an encoder ({draft.model_type}): it cannot generate")
        if draft.vocab_size != self.hf_config.vocab_size:
            raise ValueError(
                f"the draft model {spec.model} has a vocabulary of {draft.vocab_size} tokens, the model "
                f"{self.hf_config.vocab_size}: a draft model must share the model's tokenizer"
            )
        if draft.max_position_embeddings < self.max_model_len:
            raise ValueError(
                f"the draft model {spec.model} holds {draft.max_position_embeddings} positions, "
                f"fewer than max_model_len {self.max_model_len}"
            )

    @property
    def resolved_kv_cache_dtype(self) -> str:
        """The KV cache's torch dtype name: ``kv_cache_dtype``'s, or the model's (``auto``)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.resolved_dtype

    def _resolve_max_model_len(self) -> int:
        from raypaged.model.architecture import applies_sliding_window

        if self.max_model_len in (-1, "auto"):
            self.fit_max_model_len, self.max_model_len = True, None
        limit, what = self.hf_config.max_position_embeddings, "max_position_embeddings"
        if self.encoder:  # RoBERTa's first position row is padding_idx + 1
            from raypaged.model.encoder import max_prompt_len

            limit, what = max_prompt_len(self.hf_config), "position embeddings"
        window = getattr(self.hf_config, "sliding_window", None)
        if window and (self.encoder or applies_sliding_window(self.hf_config)):  # the layers apply it
            window = None
        if window and getattr(self.hf_config, "use_sliding_window", True) and window < limit:
            # attention here is full-context: stay inside the window (vLLM's --disable-sliding-window)
            limit, what = window, "sliding_window (attention here spans the whole context)"
        if self.max_model_len is None:
            return limit
        if not isinstance(self.max_model_len, int):
            raise ValueError(f"max_model_len takes a number of tokens, or auto, got {self.max_model_len!r}")
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's {what} {limit}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        return self.max_model_len

    def _check_admission_limits(self) -> None:
        """The batch cap and the admission limits (vLLM's), and the histogram buckets."""
        from raypaged.serving.buckets import check_custom_buckets

        active = self.max_num_active_seqs
        if active is not None and not 1 <= active <= self.max_num_seqs:
            raise ValueError(
                f"--max-num-active-seqs must be from 1 to --max-num-seqs {self.max_num_seqs}, got {active}"
            )
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            if (limit := getattr(self, name)) is not None and limit < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 0, got {limit}")
        check_custom_buckets(self.custom_histogram_buckets)

    def _resolve_runner(self) -> None:
        """``pooler`` for an embedding model (``--runner``, ``--convert``), and the options an embedding model
        runs without: each refused by name when given."""
        architectures = list(getattr(self.hf_config, "architectures", None) or [])
        task = resolve_runner(self.runner, self.convert, architectures)
        if task is None:
            if self.pooler_config is not None:
                raise ValueError("--pooler-config applies to embedding models (--runner pooling)")
            if self.whole_prompts:
                raise ValueError(
                    f"{architectures} with use_bidirectional_attention attends to whole prompts: it embeds (--runner "
                    "pooling), it cannot generate"
                )
            return
        if task == "classify" and getattr(self.hf_config, "classifier_from_token", None) is not None:
            from raypaged.inputs.tokenizer import load_tokenizer

            set_classifier_tokens(self.hf_config, load_tokenizer(self.tokenizer_path, self.resolved_tokenizer_mode))
        self.pooler = pooler = resolve_pooler(
            self.model_path, self.hf_config, self.pooler_config, task, self._default_pooling()
        )
        for given, flag in (
            (self.speculative_config is not None, "--speculative-config"),
            (self.enable_lora, "--enable-lora"),
            (self.async_scheduling, "--async-scheduling"),
        ):
            if given:
                raise ValueError(f"{flag} applies to generation: an embedding model (--runner pooling) runs without it")
        if self.whole_prompts and self.enable_prefix_caching:
            self.enable_prefix_caching = False
            logger.info("prefix caching is off: every token attends to its whole prompt, which is computed whole")
        elif pooler.needs_every_token and self.enable_prefix_caching:
            self.enable_prefix_caching = False
            logger.info(
                "embedding model: prefix caching is off (%s pooling reads every prompt token's hidden state, "
                "which a cached prefix would skip)",
                pooler.pooling_type,
            )
        if task == "classify":
            logger.info(
                "classifier: %d labels (%s) from its %s token's state",
                len(pooler.labels),
                pooler.labels,
                "first" if pooler.pooling_type == "CLS" else "last",
            )
        else:
            logger.info(
                "embedding model: %s pooling, %snormalized", pooler.pooling_type, "" if pooler.normalize else "not "
            )

    def _default_pooling(self) -> str:
        """The pooling type a model reads unless told otherwise: a decoder's last token, an encoder's first (a
        ModernBERT classifier's, its ``classifier_pooling``)."""
        from raypaged.model.encoder import classifier_pooling

        return classifier_pooling(self.hf_config) if self.encoder else "LAST"

    def _check_async_scheduling(self) -> None:
        if not self.async_scheduling:
            return
        if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
            shards = f"tensor_parallel_size is {self.tensor_parallel_size}"
            if self.pipeline_parallel_size > 1:
                shards += f", pipeline_parallel_size {self.pipeline_parallel_size}"
            raise ValueError(
                f"--async-scheduling runs on one shard: the next step needs the tokens only rank 0 samples ({shards}; "
                "use --no-async-scheduling)"
            )
        if self.speculative_config is not None:
            raise ValueError(
                "--async-scheduling cannot run with --speculative-config: the next step's drafts "
                "depend on the tokens the step before accepts (use --no-async-scheduling)"
            )

    @property
    def resolved_async_scheduling(self) -> bool:
        """``async_scheduling``, or when not set: on CUDA with one shard and no speculative decoding."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        if self.pooler is not None:  # a request ends with its prefill: no next token to schedule ahead for
            return False
        return (
            self.resolved_device == "cuda"
            and self.tensor_parallel_size == 1
            and self.pipeline_parallel_size == 1
            and self.speculative_config is None
        )

    @property
    def uses_ray(self) -> bool:
        """Shards run as Ray actors: more than one, or a Ray cluster was named."""
        return self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1 or self.ray_address is not None

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_swap_space(self) -> float:
        """GiB of CPU swap: on the CPU device the KV pool already lives in host memory, so none by default."""
        if self.swap_space is not None:
            return self.swap_space
        return DEFAULT_GPU_SWAP_SPACE_GIB if self.resolved_device == "cuda" else 0.0

    @property
    def resolved_dtype(self) -> str:
        """A torch dtype name: ``auto`` keeps the checkpoint's, but half on CPU becomes float32."""
        dtype = _DTYPES[self.dtype]
        if dtype != "auto":
            return dtype
        checkpoint = str(getattr(self.hf_config, "dtype", None) or "float32").replace("torch.", "")
        if self.resolved_device == "cpu":
            return "float32" if checkpoint == "float16" else checkpoint
        return "float16" if checkpoint == "float32" else checkpoint


def _chat_template_text(template: str | None) -> str | None:
    """``--chat-template``'s template: a file's text, or the value itself when it is a Jinja template."""
    if template is None:
        return None
    path = Path(template).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in template or "{%" in template:
        return template
    raise ValueError(f"--chat-template {template!r} is neither a file nor a Jinja template")


def overridden_hf_config(model_path: Path, overrides: dict[str, Any], values: dict[str, Any] | None = None) -> Any:
    """The model's config as if its config.json (or ``values``: a config read from another format) held
    ``overrides`` too (``--hf-overrides``): an object merges into the object it names, key by key; the config class
    then reads the merged values as it reads the file's."""
    from transformers import AutoConfig, PretrainedConfig

    if not isinstance(overrides, dict):
        raise ValueError(f"--hf-overrides takes a JSON object, got {json.dumps(overrides)}")
    if values is None:
        values, _ = PretrainedConfig.get_config_dict(str(model_path))
    merged = _merged(values, overrides)
    model_type = merged.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ValueError(f"--hf-overrides: the config has no model_type to read it as (got {model_type!r})")
    return AutoConfig.for_model(model_type, **merged)


def _merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def check_architecture(hf_config: Any, what: str) -> None:
    """``ValueError`` naming ``what`` unless one of the config's architectures is supported, with the options
    of its model type and rotary embedding that raypaged computes."""
    from raypaged.model.architecture import SUPPORTED_ARCHITECTURES, architecture_of
    from raypaged.model.encoder import ENCODER_ARCHITECTURES, check_encoder, is_encoder
    from raypaged.model.layers import rope_parameters

    archs = getattr(hf_config, "architectures", None) or []
    if is_encoder(hf_config):
        if not any(a in ENCODER_ARCHITECTURES for a in archs):
            raise ValueError(
                f"{what} architecture {archs} is not supported (encoders: {', '.join(ENCODER_ARCHITECTURES)})"
            )
        check_encoder(hf_config)
        return
    # a base model without its language-model head (Qwen3Model, ...) is an embedding model of its family
    if not any(a in SUPPORTED_ARCHITECTURES or _causal_lm_of(a) in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(
            f"{what} architecture {archs} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)}, their "
            f"*Model and *ForSequenceClassification, and the encoders {', '.join(ENCODER_ARCHITECTURES)})"
        )
    architecture_of(hf_config)
    rope_parameters(hf_config)


_BASE_MODELS = {"Gemma3TextModel": "Gemma3ForCausalLM"}  # base models not named as their causal LM minus its suffix


def _causal_lm_of(architecture: str) -> str:
    """``Qwen3Model`` -> ``Qwen3ForCausalLM`` (a base model's generative architecture), and a classifier's
    (``Qwen3ForSequenceClassification``) likewise."""
    if architecture in _BASE_MODELS:
        return _BASE_MODELS[architecture]
    for suffix in ("ForSequenceClassification", "Model"):
        if architecture.endswith(suffix):
            return architecture.removesuffix(suffix) + "ForCausalLM"
    return architecture
