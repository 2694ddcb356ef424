"""Where a model's files are: a local folder, or a Hugging Face Hub id resolved through the standard cache.

A Hub id (``org/name``) becomes a snapshot folder of the Hugging Face cache
(``$HF_HUB_CACHE``, by default ``$HF_HOME/hub``; ``--download-dir`` replaces it),
downloaded with ``huggingface_hub`` when missing. Only what raypaged reads is
fetched: the config, the generation config, the tokenizer files and the
safetensors weights. With ``HF_HUB_OFFLINE=1`` nothing is downloaded and the
cached snapshot of the revision (``refs/<branch or tag>``, or a commit hash) is used.
"""

from __future__ import annotations

import logging
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
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = Path(download_dir).expanduser() if download_dir is not None else Path(constants.HF_HUB_CACHE)
    at = f" at revision {revision!r}" if revision is not None else ""
    offline = constants.HF_HUB_OFFLINE
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            allow_patterns=list(patterns),
            ignore_patterns=list(ignored) or None,
            local_files_only=offline,
            token=token,
        )
    except HFValidationError:
        raise ValueError(f"{what} {repo_id!r} is neither a local folder nor a Hugging Face Hub id (org/name)") from None
    except LocalEntryNotFoundError as exc:
        if offline:
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
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ValueError(f"{what} {repo_id!r}{at}: its snapshot {path} holds no config.json")
    logger.info("%s %s%s: %s", what, repo_id, at, path)
    return path
