"""One model replica in one process: load once, generate a batch with any strategy.

The strategies and how each builds its drafter are `pipeline.strategies`; transformers'
`generate()`, the outside reference, is `pipeline.decoding.hf_reference.HFReference`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from pipeline.decoding.batch_drafts import DeviceStepCost
from pipeline.decoding.decode import decode
from pipeline.decoding.drafters import Drafter
from pipeline.decoding.hf_reference import HFReference
from pipeline.decoding.loop import DecodeConfig, GenerationResult, Prefilled, prefill
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.scheduler import ContinuousBatcher, GenerationRequest
from pipeline.decoding.step_cost import StepCost
from pipeline.decoding.stopping import SentenceEnds, SentenceStop, eos_token_ids
from pipeline.errors import ConfigError
from pipeline.knapspec.latency import LatencyModel
from pipeline.model import checkpoint
from pipeline.model.graphs import GraphSettings
from pipeline.model.linear import ComputeMode, resolve_compute_mode
from pipeline.model.loading import model_from_tensors
from pipeline.model.sublayer_model import SublayerModel
from pipeline.strategies import (  # noqa: F401 (the strategies' names, where users import them from)
    REGISTRY,
    SEARCHING_STRATEGIES,
    STRATEGIES,
    DrafterFactory,
    Strategy,
    StrategyConfig,
)

logger = logging.getLogger(__name__)


class Calibrator(Protocol):
    """Where the searching strategies' latency table comes from, built by whoever owns
    calibration (profiling.calibration.store_calibrator): the engine asks only when a searching
    strategy first needs one. `record` keeps the fit of the engine's timed batch steps with
    the table, for the next engine."""

    def __call__(self, model: SublayerModel, model_name: str, force: bool) -> LatencyModel: ...

    def record(self, model: SublayerModel, model_name: str, cost: StepCost, steps: int) -> bool: ...


# Requests a replica decodes together unless told otherwise (docs/speed.md, "Batches").
DEFAULT_MAX_BATCH = 8


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # a checkpoint folder; None for the embedded model
    dtype: str = "auto"
    device: str = "cpu"
    cache_dir: Path | None = None
    # The latency model of the searching strategies (a LatencyModel, or a PipelineLatency
    # of stage tables); None: the engine's calibrator measures or loads one on first use.
    latency: LatencyModel | None = None
    # Where calibrations are stored; read by whoever builds the engine's calibrator.
    calibration_dir: Path | None = None
    # A batch's KV memory (decoding/kv_room.py): what its caches take together (None: on a GPU,
    # most of its free memory; else room for `max_batch` of the longest request), and that
    # longest request, prompt and answer, in positions (None: the model's whole context).
    kv_cache_bytes: int | None = None
    kv_slot_positions: int | None = None
    # On CUDA, decode, verify and draft steps run as captured CUDA graphs (pipeline/model/graphs);
    # True runs every step eagerly, kernel by kernel (vLLM's enforce_eager).
    enforce_eager: bool = False


class Engine:
    def __init__(self, config: EngineConfig, model=None, calibrator: Calibrator | None = None) -> None:
        """`model`: an already built model of `config.model` with the SublayerModel interface
        (a PipelineModel over stage actors); None loads the whole model in this process.
        `calibrator`: where the searching strategies' latency model comes from when
        `config.latency` is None."""
        self.config = config
        self.device = torch.device(config.device)
        self.mode: ComputeMode = resolve_compute_mode(config.dtype, self.device)
        self.path = checkpoint.resolve_checkpoint(config.model, config.cache_dir)
        self.hf_config = checkpoint.load_config(self.path)
        self.tokenizer = checkpoint.load_tokenizer(self.path)
        if model is None:
            model = model_from_tensors(
                self.hf_config, checkpoint.read_tensors(self.path), self.mode, self.device
            )
        self.model = model
        if self.device.type == "cuda" and not config.enforce_eager and isinstance(model, SublayerModel):
            # (a pipelined model's stages run their own steps eagerly)
            model.use_graphs(GraphSettings(capture="cuda"))
        self.eos_token_ids = eos_token_ids(self.path, self.hf_config, self.tokenizer)
        self.sentences = SentenceEnds(self.tokenizer)
        self.hf = HFReference(self.path, self.device, self.mode, self.tokenizer.pad_token_id)
        self._latency = config.latency
        self._calibrator = calibrator
        self._drafters = DrafterFactory(self.model.spec, lambda: self.latency)
        self._calibrated = False  # the latency table came from the calibrator (its corrections are ours to record)
        self._step_cost = DeviceStepCost(self._record_step_cost)
        logger.info("Loaded %s (%d layers) in %s mode", self.path.name, self.model.spec.num_layers, self.mode.value)

    @property
    def name(self) -> str:
        return checkpoint.EMBEDDED_MODEL if self.config.model is None else str(self.config.model)

    @property
    def latency(self) -> LatencyModel:
        if self._latency is None:
            self.calibrate()
        return self._latency

    def calibrate(self, force: bool = False) -> LatencyModel:
        """This model's latency table from the calibrator (stored or measured; `force`
        re-measures: a machine whose load changed)."""
        if self._calibrator is None:
            raise ConfigError(
                "no latency model for the searching strategies: pass EngineConfig(latency=...) "
                "or a calibrator (profiling.calibration.store_calibrator)"
            )
        if not isinstance(self.model, SublayerModel):
            # A sharded model is timed by its stages, on their devices (PipelineModel.calibrate).
            raise ConfigError("this engine's model runs elsewhere: pass its latency model in EngineConfig(latency=...)")
        self._latency = self._calibrator(self.model, self.name, force)
        self._calibrated = True
        self._step_cost = DeviceStepCost(self._record_step_cost)  # a new table: fit from it afresh
        return self._latency

    def _record_step_cost(self, cost: StepCost, steps: int) -> None:
        if self._calibrator is None or not self._calibrated:
            return  # a table given in the config: the store holds nothing of it to correct
        try:
            if self._calibrator.record(self.model, self.name, cost, steps):
                logger.info("kept the fit of %d timed steps with this device's latency table", steps)
        except OSError as e:
            logger.warning("could not keep the step-cost fit with the latency table: %s", e)

    def drafter(self, strategy: StrategyConfig) -> Drafter:
        return self._drafters.build(strategy)

    def prefill(self, prompt_ids: torch.Tensor, max_new_tokens: int) -> Prefilled:
        return prefill(self.model, prompt_ids, max_new_tokens)

    def request(
        self,
        prompt_ids: torch.Tensor,
        strategy: StrategyConfig,
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
    ) -> GenerationRequest:
        """One request for a batch, with its own drafter of `strategy`."""
        self._check_context(prompt_ids, max_new_tokens)
        if not strategy.ours:
            raise ConfigError(f"strategy {strategy.name!r} is transformers' generate(): it batches by itself")
        return GenerationRequest(prompt_ids, self.decode_config(max_new_tokens, params), params, self.drafter(strategy))

    def decode_config(self, max_new_tokens: int, params: SamplingParams) -> DecodeConfig:
        """Where a request's answer ends: EOS, the budget, and the sentence rule if `params` ask."""
        after = params.end_on_sentence_after
        return DecodeConfig(
            max_new_tokens, self.eos_token_ids, None if after is None else SentenceStop(self.sentences, after)
        )

    def batcher(self, max_batch: int, slot_positions: int | None = None) -> ContinuousBatcher:
        """A continuous batcher over this engine's model (`submit` the engine's `request`s), its
        KV pool made once at its first admission; `slot_positions`: the longest request it serves,
        where the config does not say. A whole model's batchers run one at a time and share one fit of the
        device's step cost; a pipelined replica's lanes step concurrently and fit their own."""
        budget = self._step_cost.budget() if isinstance(self.model, SublayerModel) else None
        slot_positions = self.config.kv_slot_positions or slot_positions
        return ContinuousBatcher(
            self.model, max_batch, self.config.kv_cache_bytes, budget=budget, slot_positions=slot_positions
        )

    @property
    def step_cost(self) -> DeviceStepCost:
        """The fit of this device's step cost that the engine's batchers share."""
        return self._step_cost

    def generate_batch(
        self,
        prompts: Sequence[torch.Tensor],
        strategy: StrategyConfig,
        max_new_tokens: int,
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> list[GenerationResult]:
        """Generate for every prompt, up to `max_batch` at a time (continuous batching; for `hf`,
        left-padded generate() batches). Results in the prompts' order; the first failure raises."""
        per_request = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_request) != len(prompts):
            raise ConfigError(f"{len(prompts)} prompts but {len(per_request)} sampling settings")
        if not strategy.ours:
            return self._generate_hf_batches(prompts, strategy, max_new_tokens, per_request, max_batch)
        requests = [self.request(p, strategy, max_new_tokens, q) for p, q in zip(prompts, per_request)]
        # Slots as long as this batch's longest request, unless the config says how long.
        batcher = self.batcher(max_batch, max((r.positions for r in requests), default=None))
        tickets = [batcher.submit(request) for request in requests]
        done = {finished.ticket: finished for finished in batcher.run()}
        self._step_cost.flush()
        for ticket in tickets:
            if done[ticket].error is not None:
                raise done[ticket].error
        return [done[ticket].result for ticket in tickets]

    def generate(
        self,
        prompt_ids: torch.Tensor,
        strategy: StrategyConfig,
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        prefilled: Prefilled | None = None,
    ) -> GenerationResult:
        """Generate after `prompt_ids` (1-D): a batch of one. `prefilled` reuses a prefilled cache (consumed)."""
        config = self.decode_config(max_new_tokens, params)
        self._check_context(prompt_ids, max_new_tokens)
        if not strategy.ours:
            return self.hf.generate(prompt_ids, config, params, _hf_lookup(strategy))
        drafter = self.drafter(strategy)
        if prefilled is None:
            prefilled = self.prefill(prompt_ids, max_new_tokens)
        budget = self._step_cost.budget() if isinstance(self.model, SublayerModel) else None
        return decode(self.model, prefilled, config, params, drafter, prompt_ids.tolist(), budget)

    def _check_context(self, prompt_ids: torch.Tensor, max_new_tokens: int) -> None:
        if prompt_ids.numel() + max_new_tokens > self.model.max_context:
            raise ConfigError(
                f"{prompt_ids.numel()} prompt tokens + {max_new_tokens} new tokens exceed this model's "
                f"{self.model.max_context}-token context; shorten the prompt or lower max_new_tokens"
            )

    def _generate_hf_batches(
        self,
        prompts: Sequence[torch.Tensor],
        strategy: StrategyConfig,
        max_new_tokens: int,
        params: list[SamplingParams],
        max_batch: int,
    ) -> list[GenerationResult]:
        if strategy.name != "hf" or max_batch == 1:
            # transformers' prompt lookup takes one sequence at a time.
            return [self.generate(p, strategy, max_new_tokens, q) for p, q in zip(prompts, params)]
        for prompt in prompts:
            self._check_context(prompt, max_new_tokens)
        return self.hf.generate_batches(prompts, self.decode_config(max_new_tokens, params[0]), params, max_batch)


def _hf_lookup(strategy: StrategyConfig) -> int | None:
    """Draft tokens of transformers' own prompt lookup (`hf-lookup`); None for plain generate()."""
    return strategy.max_draft if strategy.name == "hf-lookup" else None
