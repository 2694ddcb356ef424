"""Where a model's files are: a local folder, or a Hugging Face Hub id resolved through the standard cache.

A Hub id (``org/name``) becomes a snapshot folder of the Hugging Face cache
(``$HF_HUB_CACHE``, by default ``$HF_HOME/hub``; ``--download-dir`` replaces it),
downloaded with ``huggingface_hub`` when missing. Only what raypaged reads is
fetched: the config, the generation config, the tokenizer files and the
safetensors weights. With ``HF_HUB_OFFLINE=1`` nothing is downloaded and the
cached snapshot of the revision (``refs/<branch or tag>``, or a commit hash) is used.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path

from raypaged.inputs.tokenizer import SENTENCEPIECE_GLOB, TEKKEN
from raypaged.model import mistral_format

logger = logging.getLogger("raypaged")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
    TEKKEN,  # Mistral's own tokenizers (--tokenizer-mode mistral reads Tekken, names SentencePiece's to refuse it)
    SENTENCEPIECE_GLOB,
)
MODEL_FILES = (
    "config.json",
    "params.json",  # Mistral's own format (its weights are consolidated*.safetensors)
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    *TOKENIZER_FILES,
)


def refuse_hub_options(
    name: str, revision: str | None, download_dir: str | None, what: str = "model", kind: str = "a local folder"
) -> None:
    """A ``ValueError`` naming the flag where ``--revision`` (``--tokenizer-revision``) or ``--download-dir``, which
    apply to Hub ids, is given for ``name``, which is ``kind`` on disk."""
    for flag, value in (
        (f"--{what}-revision" if what != "model" else "--revision", revision),
        ("--download-dir", download_dir),
    ):
        if value is not None:
            raise ValueError(f"{flag} {value} applies to Hugging Face Hub ids, but {what} {name!r} is {kind}")


def resolve_model_files(
    name: str,
    revision: str | None,
    download_dir: str | None,
    what: str = "model",
    weights: bool = True,
    token: str | bool | None = None,
    formats: tuple[str, str] = ("auto", "auto"),
) -> Path:
    """A local folder for ``name``: the folder itself when it exists (it must hold a config.json, or for a
    tokenizer its tokenizer files), else the Hub snapshot of ``revision`` (default ``main``) under
    ``download_dir`` or the Hugging Face cache.

    ``what`` names the flag in messages (``model``, ``tokenizer``); ``weights=False`` fetches the config
    and tokenizer files only; ``token`` (``--hf-token``) authenticates Hub downloads (``True``: the saved
    login; ``None``: ``$HF_TOKEN`` or the saved login); ``formats`` (``--config-format``, ``--load-format``) decide
    which weights a Hub id fetches (``weight_patterns``). Every failure is a ``ValueError`` naming ``name`` and
    what to change.
    """
    path = Path(name).expanduser()
    if path.exists():
        if what == "tokenizer":
            if not any((path / file).is_file() for file in ("tokenizer.json", "tokenizer_config.json")) and not any(
                path.glob(pattern) for pattern in (TEKKEN, SENTENCEPIECE_GLOB)
            ):
                raise ValueError(
                    f"tokenizer {name!r} is not a tokenizer folder (no tokenizer.json or tokenizer_config.json there, "
                    f"nor Mistral's {TEKKEN} or {SENTENCEPIECE_GLOB})"
                )
        elif not any((path / file).is_file() for file in ("config.json", "params.json")):
            raise ValueError(
                f"{what} {name!r} is not a model folder (no config.json, nor Mistral's params.json, there)"
            )
        refuse_hub_options(name, revision, download_dir, what, "a local folder")
        return path
    if not weights:
        return _snapshot(name, revision, download_dir, what, ("config.json", *TOKENIZER_FILES), token)
    # one format's weights, where a repository holds Hugging Face's and Mistral's (as most of Mistral's do)
    configs = _snapshot(name, revision, download_dir, what, ("config.json", "params.json"), token)
    files, ignored = weight_patterns(configs, *formats)
    return _snapshot(name, revision, download_dir, what, files, token, ignored)


def weight_patterns(folder: Path, config_format: str, load_format: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The files to fetch of a model whose configs are in ``folder``, and those to leave out: Mistral's
    ``consolidated*.safetensors`` where its format is read (``--load-format mistral``, or ``params.json`` read as
    the config), else every other ``*.safetensors``, never both sets of weights."""
    if load_format == "mistral" or (
        load_format == "auto" and mistral_format.reads_mistral_config(folder, config_format)
    ):
        return (*[f for f in MODEL_FILES if f != "*.safetensors"], mistral_format.WEIGHTS_GLOB), ()
    return MODEL_FILES, (mistral_format.WEIGHTS_GLOB,)


def _snapshot(
    repo_id: str,
    revision: str | None,
    download_dir: str | None,
    what: str,
    patterns: tuple[str, ...],
    token: str | bool | None,
    ignored: tuple[str, ...] = (),
) -> Path:
    """The cached snapshot folder of ``repo_id`` at ``revision``, downloading it where the network allows (the files
    of ``patterns`` but those of ``ignored``)."""
    from huggingface_hub import constants, snapshot_download

    cache = _cache(download_dir)
    at = f" at revision {revision!r}" if revision is not None else ""
    with _hub_errors(repo_id, revision, cache, what):
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            allow_patterns=list(patterns),
            ignore_patterns=list(ignored) or None,
            local_files_only=constants.HF_HUB_OFFLINE,
            token=token,
        )
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ValueError(f"{what} {repo_id!r}{at}: its snapshot {path} holds no config.json")
    logger.info("%s %s%s: %s", what, repo_id, at, path)
    return path


def _cache(download_dir: str | None) -> Path:
    from huggingface_hub import constants

    return Path(download_dir).expanduser() if download_dir is not None else Path(constants.HF_HUB_CACHE)


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None, cache: Path, what: str) -> Iterator[None]:
    """huggingface_hub's failures for ``repo_id`` as ``ValueError``s naming it and what to change."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision is not None else ""
    try:
        yield
    except HFValidationError:
        raise ValueError(f"{what} {repo_id!r} is neither a local folder nor a Hugging Face Hub id (org/name)") from None
    except LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            raise ValueError(
                f"{what} {repo_id!r}{at} is not a local folder and not in the Hugging Face cache {cache} "
                "(HF_HUB_OFFLINE=1: nothing is downloaded); unset HF_HUB_OFFLINE to download it, or give its "
                "local folder"
            ) from None
        raise ValueError(
            f"{what} {repo_id!r}{at} is not in the Hugging Face cache {cache} and could not be downloaded "
            f"({str(exc).splitlines()[0]})"
        ) from None
    except GatedRepoError:
        raise ValueError(
            f"{what} {repo_id!r} is gated on the Hugging Face Hub: accept its terms on the Hub and set HF_TOKEN "
            "or --hf-token"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{what} {repo_id!r} is neither a local folder nor a model on the Hugging Face Hub "
            "(private models need HF_TOKEN or --hf-token)"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(f"{what} {repo_id!r} has no revision {revision!r} on the Hugging Face Hub") from None
    except EntryNotFoundError as exc:
        raise ValueError(f"{what} {repo_id!r}{at}: {str(exc).splitlines()[0]}") from None


# vLLM's and llama.cpp's GGUF Hub ids: ``org/name:QUANT``, one GGUF file of the repository by its quantization type
GGUF_HUB_ID = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+):(?P<quant>[\w.-]+)")
# a GGUF file split into parts, as llama.cpp's gguf-split names them
_GGUF_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def is_gguf_hub_id(name: str) -> bool:
    """Whether ``name`` is ``org/name:QUANT`` and no local path."""
    return GGUF_HUB_ID.fullmatch(name) is not None and not Path(name).expanduser().exists()


def gguf_quant_of(filename: str, quant: str) -> bool:
    """Whether GGUF file ``filename`` is of quantization type ``quant`` (in any case, between the name's - . _
    separators, as ``Qwen3-0.6B-Q4_K_M.gguf`` or ``qwen2.5-0.5b-instruct-q4_k_m.gguf``), not a vision projector."""
    name = Path(filename).name
    if not name.endswith(".gguf") or name.lower().startswith("mmproj"):
        return False
    stem = _GGUF_PART.sub(".gguf", name)[: -len(".gguf")]
    return re.search(rf"(^|[-._]){re.escape(quant)}$", stem, re.IGNORECASE) is not None


def resolve_gguf_hub_file(name: str, revision: str | None, download_dir: str | None, token: str | bool | None) -> Path:
    """The local GGUF file of ``org/name:QUANT`` at ``revision``: the repository's one ``.gguf`` file of that
    quantization type, downloaded alone where the network allows (offline, from the cached snapshot). None, several
    or one split into parts (merge them with llama.cpp's ``llama-gguf-split --merge``) is a ``ValueError`` naming
    the files there are."""
    from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download

    match = GGUF_HUB_ID.fullmatch(name)
    assert match is not None
    repo_id, quant = match["repo"], match["quant"]
    cache = _cache(download_dir)
    offline = constants.HF_HUB_OFFLINE
    with _hub_errors(repo_id, revision, cache, "model"):
        if offline:  # the cached snapshot's files (nothing is fetched)
            folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
            files = sorted(str(path.relative_to(folder)) for path in folder.rglob("*.gguf"))
        else:
            files = sorted(HfApi(token=token).list_repo_files(repo_id, revision=revision))
    chosen = [file for file in files if gguf_quant_of(file, quant)]
    ggufs = [file for file in files if file.endswith(".gguf")]
    if not chosen:
        raise ValueError(
            f"model {name!r}: {repo_id} has no GGUF file of type {quant} (its GGUF files: {', '.join(ggufs) or 'none'})"
        )
    if len(chosen) > 1:
        parts = "split into parts: merge them with llama.cpp's llama-gguf-split --merge and serve the merged file"
        why = parts if all(_GGUF_PART.search(file) for file in chosen) else "several files are of that type"
        raise ValueError(f"model {name!r}: {', '.join(chosen)} in {repo_id} are {quant}, {why}")
    with _hub_errors(repo_id, revision, cache, "model"):
        path = Path(
            hf_hub_download(
                repo_id, chosen[0], revision=revision, cache_dir=cache, local_files_only=offline, token=token
            )
        )
    logger.info("model %s: %s", name, path)
    return path
