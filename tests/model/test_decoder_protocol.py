"""The whole model and the pipelined one give the loop one interface (model/decoder.py), and
their caches one behaviour: the same members with the same parameters, the same errors."""

from __future__ import annotations

import inspect

import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.model.decoder import Cache, DecoderModel
from pipeline.model.kv_cache import CacheOverflow
from pipeline.model.linear import ComputeMode
from pipeline.model.packing import RequestRows
from pipeline.model.sublayer_model import SublayerModel
from pipeline.parallel.staged_model import PipelineModel
from tests.builders import load_tiny


def protocol_members(protocol) -> dict[str, object]:
    return {
        name: value
        for name, value in vars(protocol).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }


def parameters(function) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("model_class", [SublayerModel, PipelineModel])
def test_both_models_have_every_method_of_the_protocol_with_its_parameters(model_class):
    """A model's method takes the protocol's parameters, in order, with the same defaults; more
    only with defaults of their own."""
    for name, member in protocol_members(DecoderModel).items():
        if isinstance(member, property):
            continue  # an instance attribute may stand for it (checked on instances below)
        assert hasattr(model_class, name), f"{model_class.__name__} lacks {name}"
        got, expected = parameters(getattr(model_class, name)), parameters(member)
        assert got[: len(expected)] == expected, (model_class.__name__, name)
        assert all(default is not inspect.Parameter.empty for _, default in got[len(expected) :]), (model_class, name)


@pytest.fixture(scope="module")
def models(tiny_llama):
    return [load_tiny(tiny_llama, "fp32")[1], PipelineModel.local(tiny_llama, 2, ComputeMode.FP32)]


def test_both_models_and_their_caches_satisfy_the_protocols_and_agree(models):
    whole, pipeline = models
    ids = torch.tensor([5, 9, 2, 7, 1, 3])
    results = []
    for model in models:
        assert isinstance(model, DecoderModel)  # every member there, attributes included
        cache = model.new_cache(8)
        assert isinstance(cache, Cache)
        out = model.forward(cache, ids, 0, logits="all", return_hidden=True)
        (batched,) = model.forward_batch([RequestRows(cache, ids[-2:], 4)], logits="last")
        results.append((out.logits, out.hidden_states, batched))
        model.release(cache)
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert whole.pooled_caches and whole.new_pool(2, 8).num_free == 2
    assert not pipeline.pooled_caches
    with pytest.raises(ConfigError, match="no pool"):
        pipeline.new_pool(2, 8)


def test_every_cache_overflows_and_crops_alike(models):
    for model in models:
        cache = model.new_cache(8)
        with pytest.raises(CacheOverflow, match="overflow: position 9 is past its capacity 8"):
            model.forward(cache, torch.arange(9), 0)
        with pytest.raises(CacheOverflow):
            cache.commit(9)
        cache.commit(6)
        cache.crop(4)
        assert cache.length == 4
        with pytest.raises(ValueError, match="cannot crop"):
            cache.crop(5)
        model.release(cache)
