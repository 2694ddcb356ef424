"""The offline Python API: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import MISSING, fields, replace
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
from tqdm.auto import tqdm

from raypaged.config import EngineConfig
from raypaged.core.beam_search import BeamSearchParams
from raypaged.core.stats import SchedulerStats
from raypaged.engine.llm_engine import LLMEngine
from raypaged.entrypoints.vllm_compat import check_default_only, task_as_runner, unknown_keyword
from raypaged.entrypoints.vllm_options import ANY_VALUE, DEFAULT_ONLY, Option
from raypaged.inputs.chat_format import CONTENT_FORMATS
from raypaged.inputs.limits import check_priority
from raypaged.inputs.multimodal_input import MultiModalInput
from raypaged.lora.request import LoRARequest
from raypaged.multimodal import has_chat_images
from raypaged.outputs import (
    BeamSearchOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from raypaged.pooling_params import POOLING_TASKS, PoolingParams
from raypaged.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from typing_extensions import TypeIs

PromptType = str | dict[str, Any]
_PROGRESS_MIN_PROMPTS = 16


class LLM:
    """An engine for offline batches, vLLM-compatible.

    ``model`` is a local Hugging Face folder (Llama, Mistral, Qwen2 families), a
    Hugging Face Hub id resolved through the Hugging Face cache (``revision``,
    ``download_dir``; see ``model/hub.py``), or ``None`` for the bundled SmolLM2-135M-Instruct.
    ``tensor_parallel_size > 1`` (or a ``ray_address``) runs the shards as Ray actors; call ``shutdown()`` to
    release them. ``quantization`` (vLLM's names: fp8, awq, gptq, compressed-tensors) is read
    from the checkpoint's ``quantization_config`` when it has one (the argument may only repeat
    it); ``"fp8"`` on a float checkpoint quantizes it at load. ``kv_cache_dtype="fp8"`` keeps
    the KV cache in one byte per element, scaled per layer by the checkpoint's K/V scales where it has
    them, or by ``calculate_kv_scales=True``'s (from the first step's keys and values), else 1.0.
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        """Every init field of ``EngineConfig`` is a keyword with the config's default (the signature,
        ``inspect.signature(LLM)``, is generated from its fields: see ``engine_keywords``); ``None``
        for ``limits`` or ``structured_outputs_config`` is their default too.

        The other keywords are vLLM engine arguments taken here at one value (``trust_remote_code``,
        ``disable_log_stats``, ``enable_chunked_prefill=True``, ``data_parallel_size=1`` ...);
        another value is refused naming it, and an unknown keyword is a ``TypeError`` naming the
        closest one there is."""
        keywords = engine_keywords()
        given = {name: options.pop(name) for name in list(options) if name in keywords}
        if "task" in options:  # vLLM's older spelling of runner and convert
            runner, convert = given.get("runner", "auto"), given.get("convert", "auto")
            options["task"], given["runner"], given["convert"] = task_as_runner(options["task"], runner, convert, False)
        _check_vllm_options(options)
        check_default_only(given, as_flags=False, options=_SERVER_ONLY)
        for name in _FACTORY_DEFAULTS:
            if name in given and given[name] is None:
                del given[name]  # as before: None stands for the config's own default object
        self.llm_engine = LLMEngine(EngineConfig(model=model, **given))

    def shutdown(self) -> None:
        """Release the shard actors and their placement group (nothing to do in-process)."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the model's generation-config defaults (``generation_config``,
        then ``override_generation_config``); ``SamplingParams()`` when there are none."""
        return self.llm_engine.config.generation_defaults.sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt is a string, ``{"prompt_token_ids": [...]}``, or (an image-text model's) ``{"prompt": text,
        "multi_modal_data": {"image": image or [images]}}`` with one image placeholder in the text per PIL image. One
        ``SamplingParams`` applies to all prompts, or pass one per prompt;
        ``priority`` (one per prompt, lower first) matters under
        ``scheduling_policy="priority"``. Every prompt is validated before any
        runs: a bad one raises ``ValueError``. Without ``sampling_params`` the
        model's defaults apply (``get_default_sampling_params()``). ``lora_request``:
        the LoRA adapter of every prompt, or one per prompt (``None``: the base model),
        as vLLM's (needs ``enable_lora=True``).
        """
        return self._generate(prompts, sampling_params, use_tqdm, priority, lora_request)

    def _generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        rendered: bool = False,
    ) -> list[RequestOutput]:
        """``generate``; ``rendered``: the prompts' texts are chat templates' renderings (``chat``'s with images)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts; pass one or one per prompt"
                )
        priorities = [0] * len(prompts) if priority is None else list(priority)
        for prio in priorities:
            check_priority(prio, self.llm_engine.config.scheduling_policy)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(
                    f"got {len(loras)} lora_request for {len(prompts)} prompts; pass one or one per prompt"
                )
        engine = self.llm_engine
        resolved = [_prompt_input(p, _GENERATE_PROMPT_KEYS) for p in prompts]
        multi_modals = [_multi_modal_input(p, rendered) for p in prompts]
        # only the finished output is read: the engine builds nothing for the steps in between
        params_list = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list]
        submissions = [
            partial(
                engine.add_request,
                text,
                params,
                prompt_token_ids=token_ids,
                priority=prio,
                cache_salt=salt,
                lora_request=lora,
                multi_modal=multi_modal,
                prompt_embeds=given.get("prompt_embeds") if isinstance(given, dict) else None,
            )
            for (text, token_ids, salt), params, prio, lora, multi_modal, given in zip(
                resolved, params_list, priorities, loras, multi_modals, prompts
            )
        ]
        return self._submit_and_run(submissions, use_tqdm)

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, use_tqdm: bool = True
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt, as vLLM's: each output's ``sequences`` are the beams, best
        score first (``tokens`` prompt then beam, ``text`` the beam's, ``cum_logprob``, ``logprobs``),
        and its ``outputs`` the same beams as ``CompletionOutput``s.

        Beams are forked sequences sharing their blocks (the prompt is stored once).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        engine = self.llm_engine
        submissions = [
            partial(engine.add_beam_search, text, params, prompt_token_ids=token_ids, cache_salt=salt)
            for text, token_ids, salt in (_prompt_input(p) for p in prompts)
        ]
        outputs = self._submit_and_run(submissions, use_tqdm)
        beams = [output for output in outputs if isinstance(output, BeamSearchOutput)]
        assert len(beams) == len(outputs), "a beam search's output is a BeamSearchOutput"
        return beams

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        documents: list[dict[str, Any]] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template_content_format: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the chat template
        (``chat_template`` replaces the model's for this call), as vLLM's ``LLM.chat`` (``mm_processor_kwargs``:
        the image processor's options for these conversations' images; ``lora_request``: as ``generate``'s;
        ``chat_template_content_format``: auto, string or openai, over the engine's)."""
        if chat_template_content_format not in (None, *CONTENT_FORMATS):
            raise ValueError(
                f"chat_template_content_format {chat_template_content_format!r} is not one of "
                f"{', '.join(CONTENT_FORMATS)}"
            )
        conversations = [messages] if _is_conversation(messages) else messages
        engine = self.llm_engine
        inputs = engine.input_processor
        options = dict(
            tools=tools,
            documents=documents,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            trusted=True,
            content_format=chat_template_content_format,
        )
        prompts: list[PromptType] = []
        with_images = [has_chat_images(c) for c in conversations]
        if any(with_images) and not all(with_images):
            raise ValueError("LLM.chat takes conversations that all have images, or none that has")
        for conversation in conversations:
            if with_images[0]:
                text, images = inputs.chat_with_images(conversation, **options)
                prompts.append(
                    {
                        "prompt": text,
                        "multi_modal_data": {"image": [inputs.loaded(i) for i in images]},
                        "mm_processor_kwargs": mm_processor_kwargs,
                    }
                )
            else:
                ids = inputs.chat_ids(conversation, **options)
                prompts.append({"prompt_token_ids": ids, "prompt": engine.tokenizer.decode(ids)})
        return self._generate(prompts, sampling_params, use_tqdm, lora_request=lora_request, rendered=with_images[0])

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        pooling_task: str | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """A pooling model's (``runner="pooling"``) output for every prompt, in input order, as vLLM's
        ``LLM.encode``: each output's ``outputs.data`` is a float32 tensor (an embedding, or a classifier's
        probabilities). ``pooling_params``: one for all prompts or one per prompt; ``pooling_task`` (``embed``,
        ``encode``, ``classify``, ``score``; default: what the model serves) and ``truncate_prompt_tokens`` (the
        prompt's last k tokens) set theirs."""
        if lora_request is not None:
            raise ValueError("lora_request: a pooling model (runner='pooling') runs without LoRA adapters")
        if pooling_task is not None and pooling_task not in POOLING_TASKS:
            raise ValueError(f"pooling_task {pooling_task!r} is not supported ({', '.join(POOLING_TASKS)})")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params_given = PoolingParams() if pooling_params is None else pooling_params
        params_list = [params_given] * len(prompts) if isinstance(params_given, PoolingParams) else list(params_given)
        if len(params_list) != len(prompts):
            raise ValueError(
                f"got {len(params_list)} pooling_params for {len(prompts)} prompts; pass one or one per prompt"
            )
        if truncate_prompt_tokens is not None:
            params_list = [replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params_list]
        if pooling_task is not None:
            params_list = [p if p.task is not None else replace(p, task=pooling_task) for p in params_list]
        engine = self.llm_engine
        submissions = [
            partial(
                engine.add_pooling_request,
                text,
                params,
                prompt_token_ids=token_ids,
                cache_salt=salt,
                token_type_ids=prompt.get("token_type_ids") if isinstance(prompt, dict) else None,
            )
            for prompt, params in zip(prompts, params_list)
            for text, token_ids, salt in [_prompt_input(prompt, _POOLING_PROMPT_KEYS)]
        ]
        return [PoolingRequestOutput.of(output) for output in self._submit_and_run(submissions, use_tqdm)]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Every prompt's embedding (``outputs.embedding``: floats), as vLLM's ``LLM.embed``."""
        outputs = self.encode(prompts, pooling_params, use_tqdm, lora_request, "embed", truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """A classifier's (a ``*ForSequenceClassification`` checkpoint) class probabilities of every prompt
        (``outputs.probs``), as vLLM's ``LLM.classify``; the arguments are ``embed``'s."""
        outputs = self.encode(prompts, pooling_params, use_tqdm, lora_request, "classify", truncate_prompt_tokens)
        return [ClassificationRequestOutput.from_base(output) for output in outputs]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ScoringRequestOutput]:
        """Each pair's score, as vLLM's ``LLM.score``: ``data_1`` one text against every text of ``data_2``, or
        the two lists pairwise. A classifier of one label (a cross-encoder) scores the pair tokenized together (the
        tokenizer's text pair) through its sigmoid; an embedding model scores the cosine similarity of the two
        embeddings."""
        firsts = [data_1] if isinstance(data_1, str) else list(data_1)
        seconds = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(firsts) not in (1, len(seconds)) or not seconds:
            raise ValueError(
                f"data_1 has {len(firsts)} texts and data_2 {len(seconds)}: give one against many, or as many of each"
            )
        first_of = [0] * len(seconds) if len(firsts) == 1 else list(range(len(seconds)))  # each pair's data_1 text
        pooler = self.llm_engine.config.pooler
        if pooler is None:
            raise ValueError(
                "LLM.score needs a pooling model (runner='pooling'): a classifier of one label or an embedding model"
            )
        if pooler.task == "classify":
            if len(pooler.labels) != 1:
                raise ValueError(
                    f"LLM.score needs a classifier of one label (a cross-encoder); this one has {len(pooler.labels)}"
                )
            inputs = self.llm_engine.input_processor
            pairs = [_pair_prompt(*inputs.pair_ids(firsts[i], b)) for i, b in zip(first_of, seconds)]
            outputs = self.encode(pairs, pooling_params, use_tqdm, lora_request, "score", truncate_prompt_tokens)
            scores = [float(output.outputs.data[0]) for output in outputs]
        else:
            # each data_1 text is embedded once (one text against many: once in all)
            vectors = self.encode(
                firsts + seconds, pooling_params, use_tqdm, lora_request, "embed", truncate_prompt_tokens
            )
            outputs = vectors[len(firsts) :]
            scores = [
                float(torch.nn.functional.cosine_similarity(vectors[i].outputs.data, b.outputs.data, dim=0))
                for i, b in zip(first_of, outputs)
            ]
        return [
            cast(ScoringRequestOutput, output.with_outputs(ScoringOutput(score), ScoringRequestOutput))
            for output, score in zip(outputs, scores)
        ]

    def _submit_and_run(self, submissions: Sequence[Callable[[], str]], use_tqdm: bool) -> list[RequestOutput]:
        """Queue every request, all or none (a bad one aborts those already queued), then run them."""
        request_ids: list[str] = []
        try:
            for submit in submissions:
                request_ids.append(submit())
        except ValueError:
            self.llm_engine.abort_request(request_ids)
            raise
        return self._run(request_ids, use_tqdm and len(request_ids) >= _PROGRESS_MIN_PROMPTS)

    def _run(self, request_ids: list[str], show_progress: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not show_progress)
        try:
            if engine.is_sleeping():  # nothing would ever step them
                raise RuntimeError("the engine is asleep: call LLM.wake_up() before giving it requests")
            while len(finished) < len(request_ids):
                for output in engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            engine.abort_request([rid for rid in request_ids if rid not in finished])
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in request_ids]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block (as vLLM's); False while requests hold blocks."""
        return self.llm_engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the model's weights and KV cache (needs ``enable_sleep_mode=True``), as vLLM's ``LLM.sleep``:
        level 1 and level 2 both free them here, and ``wake_up`` reads the weights back from the checkpoint."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what ``sleep`` freed: ``tags`` ``["weights"]`` then ``["kv_cache"]`` (to stage the memory
        they take), or both at once (``None``)."""
        self.llm_engine.wake_up(tags)

    def stats(self) -> SchedulerStats:
        """Engine counters: device and CPU blocks total/free, running/waiting/swapped
        sequences, preemptions, prefix cache queries and hits (in tokens)."""
        return self.llm_engine.stats()


def _is_conversation(messages: list[dict[str, Any]] | list[list[dict[str, Any]]]) -> TypeIs[list[dict[str, Any]]]:
    """``LLM.chat``'s ``messages`` are one conversation (its messages), not a list of conversations."""
    return bool(messages) and isinstance(messages[0], dict)


_PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
_POOLING_PROMPT_KEYS = (*_PROMPT_KEYS, "token_type_ids")  # a BERT text pair's token types (vLLM's TokensPrompt)
# an image-text model's images and its image processor's options (vLLM's TextPrompt)
_GENERATE_PROMPT_KEYS = (*_PROMPT_KEYS, "multi_modal_data", "mm_processor_kwargs", "prompt_embeds")


def _multi_modal_input(prompt: PromptType, rendered: bool) -> MultiModalInput | None:
    """A prompt's images (its ``multi_modal_data``) with its ``mm_processor_kwargs``, as vLLM's TextPrompt; None: the
    prompt has neither. ``rendered``: its text is a chat template's rendering."""
    if not isinstance(prompt, dict):
        return None
    return MultiModalInput.of(_prompt_images(prompt), prompt.get("mm_processor_kwargs"), rendered)


def _prompt_images(prompt: dict[str, Any]) -> list[Any] | None:
    """The PIL images of a prompt's ``multi_modal_data`` (``{"image": image or [images]}``, as vLLM's), or None; any
    other modality is refused by name."""
    if prompt.get("multi_modal_data") is None:
        return None
    from PIL import Image

    data = prompt["multi_modal_data"]
    if not isinstance(data, dict):
        raise ValueError(f"a prompt's multi_modal_data must be a dict of modalities, got {type(data).__name__}")
    other = next((key for key in data if key != "image"), None)
    if other is not None:
        raise ValueError(f"a prompt's multi_modal_data {other!r} is not supported: the served models read images")
    images = data.get("image")
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    for image in images:
        if not isinstance(image, Image.Image):
            raise ValueError(f"a prompt's multi_modal_data images must be PIL images, got {type(image).__name__}")
    return images


def _pair_prompt(token_ids: list[int], token_types: list[int] | None) -> dict[str, Any]:
    """A text pair's prompt (``InputProcessor.pair_ids``): its ids, and its token types where the model has them."""
    prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
    if token_types is not None:
        prompt["token_type_ids"] = token_types
    return prompt


def _prompt_input(
    prompt: PromptType, keys: tuple[str, ...] = _PROMPT_KEYS
) -> tuple[str | None, list[int] | None, str | None]:
    """(text, token ids, cache salt) of a prompt; any may be None. A key of vLLM's prompt dicts
    that raypaged does not take (``multi_modal_data``, ``prompt_embeds``...; ``token_type_ids`` but in ``keys``) is
    refused by name."""
    if isinstance(prompt, str):
        return prompt, None, None
    if isinstance(prompt, dict) and ("prompt_token_ids" in prompt or "prompt" in prompt or "prompt_embeds" in prompt):
        unknown = [key for key in prompt if key not in keys]
        if unknown:
            raise ValueError(f"a prompt's {unknown[0]!r} is not supported: a prompt dict takes {', '.join(keys)}")
        token_ids, salt = prompt.get("prompt_token_ids"), prompt.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"a prompt's cache_salt must be a non-empty string, got {salt!r}")
        return prompt.get("prompt"), None if token_ids is None else list(token_ids), salt
    raise ValueError(f"a prompt must be a string or a dict with prompt_token_ids, got {type(prompt).__name__}")


def engine_keywords() -> dict[str, inspect.Parameter]:
    """``LLM``'s engine keywords: every init field of ``EngineConfig``, in field order, with its default
    (a default factory's object); ``model`` may also come first positionally, the others by name."""
    keywords = {}
    for f in fields(EngineConfig):
        if not f.init:
            continue
        if f.default is not MISSING:
            default = f.default
        else:
            factory = f.default_factory
            assert factory is not MISSING, "every init field of EngineConfig has a default or a default factory"
            default = factory()
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if f.name == "model" else inspect.Parameter.KEYWORD_ONLY
        keywords[f.name] = inspect.Parameter(f.name, kind, default=default, annotation=f.type)
    return keywords


# fields whose default is a default factory's object: LLM takes None for them, as it always has
_BATCH = "LLM runs every prompt it is given: the queue limits refuse a server's requests (raypaged serve)"
# engine fields a server honours and an offline batch has no use for: refused when set
_SERVER_ONLY: list[Option] = [
    ("max_num_queued_reqs", (), int, (None,), _BATCH),
    ("max_num_queued_tokens", (), int, (None,), _BATCH),
    ("custom_histogram_buckets", (), str, (None,), "LLM exports no Prometheus metrics (raypaged serve does)"),
]
_FACTORY_DEFAULTS = tuple(f.name for f in fields(EngineConfig) if f.init and f.default_factory is not MISSING)


def _check_vllm_options(options: dict[str, Any]) -> None:
    default_only = {name for name, *_ in DEFAULT_ONLY}
    for name in options:
        if name not in default_only and name not in ANY_VALUE:
            raise unknown_keyword(name, engine_keywords(), [*default_only, *ANY_VALUE])
    check_default_only(options, as_flags=False)


def _signature() -> inspect.Signature:
    """``LLM.__init__``'s signature as ``inspect`` shows it: ``self``, the engine keywords (``model``
    first) and ``**vllm_options``."""
    keywords = engine_keywords()
    model = keywords.pop("model")
    return inspect.Signature(
        [
            inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            model,
            *keywords.values(),
            inspect.Parameter("vllm_options", inspect.Parameter.VAR_KEYWORD, annotation="Any"),
        ],
        return_annotation="None",
    )


LLM.__init__.__signature__ = _signature()  # type: ignore[attr-defined]
