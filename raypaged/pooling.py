"""Embedding models (``--runner pooling``): how a prompt's final hidden states become one vector.

The engine runs the prompt's prefill (in chunks like any other) and keeps, per request, what its
pooling type needs of each chunk's final-norm hidden states: the last token's (``LAST``), the first
token's (``CLS``) or their sum (``MEAN``). ``finish_embedding`` then takes the mean, cuts a matryoshka
model's vector to the dimensions asked for, and L2-normalizes it.

``PoolerSettings`` are resolved once per model, in this order: ``--pooler-config`` (vLLM's JSON), the
model folder's sentence-transformers modules (``modules.json``: its ``Pooling`` module's mode, the ``Dense``
projections after it, and whether a ``Normalize`` module follows), then ``LAST`` with normalization (vLLM's
default for a decoder converted to an embedding model). This module imports no torch until a vector is finished.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raypaged.inputs.limits import InputError
from raypaged.pooling_params import PoolingParams

if TYPE_CHECKING:
    import torch

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
# --pooler-config keys raypaged reads; vLLM's others (classification, reward and chunked-processing ones) refused
_POOLER_KEYS = ("pooling_type", "seq_pooling_type", "normalize", "use_activation", "dimensions")
# sentence-transformers Pooling modes -> pooling type (the modes raypaged has no pooling for are refused by name)
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_PREFIX = "sentence_transformers.models."
# sentence-transformers Dense activations raypaged applies, by their class path
_DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh"}


@dataclass(frozen=True, slots=True)
class DenseLayer:
    """A sentence-transformers ``Dense`` module after the pooling: ``activation(W x + b)``, its weights in ``path``."""

    path: str  # the module's folder (model.safetensors: linear.weight, linear.bias)
    in_features: int
    out_features: int
    bias: bool
    activation: str  # identity or tanh


@functools.lru_cache(maxsize=8)
def _dense_weights(path: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A Dense module's float32 weight and bias, read once."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(path) / "model.safetensors"))
    bias = tensors.get("linear.bias")
    return tensors["linear.weight"].float(), None if bias is None else bias.float()


@dataclass(frozen=True, slots=True)
class PoolerSettings:
    """One embedding model's pooling: its type, whether vectors are normalized unless a request says,
    the dimensions they are cut to unless a request says (``None``: all), its hidden size, and
    the dimensions a request may ask for (``None``: not a matryoshka model; ``()``: any up to the size)."""

    pooling_type: str
    normalize: bool  # classify: apply the activation (softmax, or sigmoid for one label), vLLM's use_activation
    dimensions: int | None
    hidden_size: int
    matryoshka: tuple[int, ...] | None
    task: str = "embed"
    labels: tuple[str, ...] = ()  # classify: each class's name (the config's id2label), in order
    dense: tuple[DenseLayer, ...] = ()  # sentence-transformers Dense projections after the pooling, in order

    @property
    def needs_every_token(self) -> bool:
        """Whether the vector reads hidden states before the last token's (so no prefix-cache hit may skip them)."""
        return self.pooling_type != "LAST"

    def check(self, params: PoolingParams) -> None:
        """``InputError`` naming the field a request's params cannot have on this model."""
        task = params.task or self.task
        if self.task == "classify" and task not in ("classify", "score"):
            raise InputError(
                "task", f"this model classifies (--convert classify): task {task!r} is not served (classify, score)"
            )
        if self.task == "embed" and task not in ("embed", "encode", "score"):
            raise InputError("task", f"this model embeds: task {task!r} is not served (embed, encode, score)")
        if params.dimensions is not None:
            if self.task == "classify":
                raise InputError("dimensions", "dimensions applies to embeddings, not to a classifier's scores")
            self.check_dimensions(params.dimensions, "dimensions")

    def check_dimensions(self, dimensions: int, where: str) -> None:
        if self.matryoshka is None:
            raise InputError(
                where,
                "Model does not support matryoshka representation, changing output dimensions will lead to poor "
                f"results (its config sets neither is_matryoshka nor matryoshka_dimensions; {where} {dimensions})",
            )
        if self.matryoshka and dimensions not in self.matryoshka:
            raise InputError(
                where, f"Model only supports {list(self.matryoshka)} for matryoshka representation, got {dimensions}"
            )
        if not 1 <= dimensions <= self.hidden_size:
            raise InputError(where, f"{where} must be between 1 and the model's {self.hidden_size}, got {dimensions}")


def resolve_runner(runner: str, convert: str, architectures: list[str]) -> str | None:
    """What the engine serves (``--runner``/``--convert`` against the checkpoint's architectures): ``None`` to
    generate, ``"embed"`` or ``"classify"`` to pool. ``auto`` pools a base model without a language-model head
    (``Qwen3Model``, ``LlamaModel``, ...) into embeddings, and classifies with a ``*ForSequenceClassification``'s
    head; it generates otherwise."""
    if runner not in RUNNERS:
        raise ValueError(f"--runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in CONVERTS:
        raise ValueError(f"--convert must be one of {', '.join(CONVERTS)}, got {convert!r} (no reward conversion)")
    classifier = bool(architectures) and all(a.endswith("ForSequenceClassification") for a in architectures)
    headless = bool(architectures) and all(not a.endswith("ForCausalLM") for a in architectures)
    pooling = runner == "pooling" or (runner == "auto" and (headless or convert in ("embed", "classify")))
    if convert in ("embed", "classify") and runner == "generate":
        raise ValueError(
            f"--convert {convert} makes a pooling model: it needs --runner pooling (or auto), not generate"
        )
    if convert == "classify" and not classifier:
        raise ValueError(
            f"--convert classify needs a classification head (a *ForSequenceClassification checkpoint's score "
            f"weight); architecture {architectures} has none"
        )
    if pooling and convert == "none" and not headless:
        raise ValueError(
            f"--runner pooling with --convert none: architecture {architectures} is a generative model; "
            "--convert embed (or auto) pools its final hidden states"
        )
    if not pooling and headless:
        raise ValueError(
            f"architecture {architectures} has no language-model head, so it cannot generate: serve it with "
            "--runner pooling (embeddings, or its classification head's scores)"
        )
    if not pooling:
        return None
    return "classify" if classifier and convert != "embed" else "embed"


def resolve_pooler(
    model_path: Path, hf_config: Any, pooler_config: dict[str, Any] | None, task: str = "embed", default: str = "LAST"
) -> PoolerSettings:
    """The model's ``PoolerSettings`` (see the module's docstring); ``ValueError`` naming what is not supported.
    ``default``: the model's own pooling type, where neither the flag nor a sentence-transformers folder says (an
    encoder's is CLS, a decoder's LAST). A classifier (``task`` classify) pools the token its head reads (that
    default: a decoder's last, an encoder's first) and applies the activation unless told not to; ``dimensions`` is
    refused for it."""
    given = dict(pooler_config or {})
    if task == "classify":
        if "dimensions" in given:
            raise ValueError("--pooler-config dimensions applies to embedding models, not to a classifier")
        labels = tuple(str(hf_config.id2label[i]) for i in range(int(hf_config.num_labels)))
        base = resolve_pooler(model_path, hf_config, {"pooling_type": default, **given}, "embed", default)
        if base.pooling_type != default:
            raise ValueError(
                f"--pooler-config pooling_type {base.pooling_type!r} is not supported for this classifier: its head "
                f"reads the {'last' if default == 'LAST' else 'first'} token's state ({default}), as transformers' "
                "*ForSequenceClassification"
            )
        return PoolerSettings(base.pooling_type, base.normalize, None, base.hidden_size, None, "classify", labels)
    unknown = sorted(set(given) - set(_POOLER_KEYS))
    if unknown:
        raise ValueError(
            f"--pooler-config {unknown[0]!r} is not supported: raypaged's pooler reads "
            f"{', '.join(_POOLER_KEYS)} (embedding models only)"
        )
    found = _sentence_transformers_pooling(model_path)
    pooling_type = given.get("pooling_type") or given.get("seq_pooling_type") or found.get("pooling_type") or default
    if pooling_type not in POOLING_TYPES:
        raise ValueError(
            f"--pooler-config pooling_type {pooling_type!r} is not supported (supported: {', '.join(POOLING_TYPES)})"
        )
    normalize = given.get("normalize", given.get("use_activation", found.get("normalize", True)))
    if not isinstance(normalize, bool):
        raise ValueError(f"--pooler-config normalize must be true or false, got {normalize!r}")
    dense: tuple[DenseLayer, ...] = found.get("dense", ())
    if dense and dense[0].in_features != int(hf_config.hidden_size):
        raise ValueError(
            f"sentence-transformers Dense module {dense[0].path} takes {dense[0].in_features} features, the model's "
            f"hidden size is {hf_config.hidden_size}"
        )
    hidden_size = dense[-1].out_features if dense else int(hf_config.hidden_size)  # the vector's size
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    matryoshka = tuple(int(d) for d in dims) if dims else () if getattr(hf_config, "is_matryoshka", False) else None
    settings = PoolerSettings(pooling_type, normalize, None, hidden_size, matryoshka, dense=dense)
    dimensions = given.get("dimensions")
    if dimensions is not None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, int):
            raise ValueError(f"--pooler-config dimensions must be an integer, got {dimensions!r}")
        try:
            settings.check_dimensions(dimensions, "--pooler-config dimensions")
        except InputError as exc:
            raise ValueError(str(exc)) from None
        settings = PoolerSettings(pooling_type, normalize, dimensions, hidden_size, matryoshka, dense=dense)
    return settings


def set_classifier_tokens(hf_config: Any, tokenizer: Any) -> None:
    """vLLM's ``classifier_from_token`` (``--hf-overrides``): a causal LM served as a classifier whose head is rows of
    its language-model head, one label per token; with ``is_original_qwen3_reranker`` (``["no", "yes"]``), one label,
    the yes row minus the no row (``sigmoid(logit_yes - logit_no)``: the reranker's p(yes)). Records the token ids
    on the config (``raypaged_classifier_token_ids``) for the loader, and the labels."""
    tokens = hf_config.classifier_from_token
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token must be a list of token strings, got {tokens!r}")
    ids = [tokenizer.convert_tokens_to_ids(token) for token in tokens]
    unknown = [t for t, i in zip(tokens, ids) if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise ValueError(f"classifier_from_token {unknown[0]!r} is not one token of the model's tokenizer")
    difference = bool(getattr(hf_config, "is_original_qwen3_reranker", False))
    if difference and len(tokens) != 2:
        raise ValueError(f"is_original_qwen3_reranker reads two classifier_from_token (no, yes), got {tokens}")
    hf_config.raypaged_classifier_token_ids = ids
    hf_config.raypaged_classifier_difference = difference
    hf_config.num_labels = 1 if difference else len(tokens)
    if not difference:
        hf_config.id2label = dict(enumerate(tokens))


def classifier_head(head: torch.Tensor, hf_config: Any) -> torch.Tensor:
    """The classifier's ``score`` weight from its language-model head ``[vocab, hidden]``
    (``set_classifier_tokens``)."""
    rows = head[hf_config.raypaged_classifier_token_ids]
    return (rows[1] - rows[0])[None] if hf_config.raypaged_classifier_difference else rows


def _sentence_transformers_pooling(model_path: Path) -> dict[str, Any]:
    """The pooling type, the Dense projections after it and the normalization a sentence-transformers folder
    (``modules.json``) declares; {} without one. A module raypaged does not run (a pooling mode it has no pooling
    for, a Dense activation other than identity and tanh, a module out of the Transformer, Pooling, Dense,
    Normalize order) is refused by name: serving the model without it would give other vectors than
    sentence-transformers does."""
    modules_file = model_path / "modules.json"
    if not modules_file.is_file():
        return {}
    modules = json.loads(modules_file.read_text())
    found: dict[str, Any] = {"normalize": False}
    dense: list[DenseLayer] = []
    for module in modules:
        kind = str(module.get("type", "")).removeprefix(_ST_PREFIX)
        if kind == "Transformer":
            continue
        if found["normalize"] or (kind == "Dense" and "pooling_type" not in found):
            raise ValueError(
                f"sentence-transformers module {module.get('type')!r} ({module.get('path')}) is out of the order "
                "raypaged runs them in: Transformer, Pooling, Dense..., Normalize"
            )
        if kind == "Dense":
            dense.append(_dense_layer(model_path / module.get("path", "")))
            found["dense"] = tuple(dense)
        elif kind == "Normalize":
            found["normalize"] = True
        elif kind == "Pooling":
            config = json.loads((model_path / module.get("path", "") / "config.json").read_text())
            modes = sorted(key for key, on in config.items() if key.startswith("pooling_mode_") and on)
            if len(modes) != 1 or modes[0] not in _ST_MODES:
                raise ValueError(
                    f"sentence-transformers pooling {modes} in {module.get('path')}/config.json is not supported "
                    f"(supported: one of {', '.join(_ST_MODES)})"
                )
            if config.get("include_prompt", True) is False:
                raise ValueError(
                    f"sentence-transformers pooling with include_prompt false ({module.get('path')}/config.json) is "
                    "not supported: raypaged pools every prompt token"
                )
            found["pooling_type"] = _ST_MODES[modes[0]]
        else:
            raise ValueError(
                f"sentence-transformers module {module.get('type')!r} ({module.get('path')}) is not supported: "
                "raypaged runs the Transformer, Pooling, Dense and Normalize modules only"
            )
    return found


def _dense_layer(folder: Path) -> DenseLayer:
    """A sentence-transformers Dense module's settings (its folder's config.json), its weights checked there."""
    config = json.loads((folder / "config.json").read_text())
    activation = _DENSE_ACTIVATIONS.get(str(config.get("activation_function", "torch.nn.modules.linear.Identity")))
    if activation is None:
        raise ValueError(
            f"sentence-transformers Dense activation {config.get('activation_function')!r} ({folder.name}) is not "
            f"supported (supported: {', '.join(_DENSE_ACTIVATIONS)})"
        )
    if not (folder / "model.safetensors").is_file():
        raise ValueError(f"sentence-transformers Dense module {folder.name} has no model.safetensors")
    return DenseLayer(
        str(folder), int(config["in_features"]), int(config["out_features"]), bool(config.get("bias", True)), activation
    )


def chunk_part(pooling_type: str, hidden: torch.Tensor, start: int, end: int, num_prompt: int) -> torch.Tensor | None:
    """What a chunk of prompt positions ``start..end-1`` (their final hidden states, ``hidden``) gives its request's
    vector, in float32: the last position's row, the first's, or the rows' sum; ``None`` when nothing."""
    if pooling_type == "LAST":
        return hidden[-1].float() if end == num_prompt else None
    if pooling_type == "CLS":
        return hidden[0].float() if start == 0 else None
    return hidden.float().sum(0)


def add_part(pooling_type: str, total: torch.Tensor | None, part: torch.Tensor, start: int) -> torch.Tensor:
    """A request's running vector after a chunk's ``part`` (a chunk from position 0 starts it again: the prompt
    is being recomputed after a preemption)."""
    if total is None or start == 0 or pooling_type != "MEAN":
        return part
    return total + part


def finish_embedding(
    total: torch.Tensor, num_prompt: int, params: PoolingParams, settings: PoolerSettings
) -> torch.Tensor:
    """The request's embedding: the mean (``MEAN``), cut to its dimensions, normalized as asked (float32, CPU); a
    classifier's scores (``total``: its head's logits) through the activation, softmax or (one label) sigmoid."""
    import torch

    if settings.task == "classify":
        activate = params.wants_normalize if params.wants_normalize is not None else settings.normalize
        if not activate:
            return total.float().cpu()
        return (torch.sigmoid(total) if total.shape[-1] == 1 else torch.softmax(total, dim=-1)).float().cpu()
    vector = total / num_prompt if settings.pooling_type == "MEAN" else total
    for layer in settings.dense:  # sentence-transformers Dense projections, in float32
        weight, bias = _dense_weights(layer.path)
        vector = torch.nn.functional.linear(vector.float(), weight, bias)
        if layer.activation == "tanh":
            vector = torch.tanh(vector)
    dimensions = params.dimensions if params.dimensions is not None else settings.dimensions
    if dimensions is not None:
        vector = vector[:dimensions]
    normalize = params.wants_normalize
    if normalize if normalize is not None else settings.normalize:
        vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
    return vector.float().cpu()
