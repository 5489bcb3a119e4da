"""One model replica in one process: load once, generate with any strategy.

Strategies are a registry (`REGISTRY`, name -> how to build its drafter and its
defaults): plain decoding, a fixed skip set, prompt lookup, KnapSpec and its hybrid, the
baselines, and transformers' `generate()` as the outside reference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.decoding.batch_drafts import DeviceStepCost
from pipeline.decoding.decode import decode
from pipeline.decoding.drafters import DEFAULT_MAX_DRAFT, Drafter, LayerSkipDrafter, NoDraft, default_static_skip
from pipeline.decoding.hf_reference import HFRun, prepare_hf_model, run_hf_generate, run_hf_generate_batch
from pipeline.decoding.loop import DecodeConfig, GenerationResult, Prefilled, prefill
from pipeline.decoding.prompt_lookup import DEFAULT_LOOKUP_MAX_DRAFT, DEFAULT_MAX_NGRAM, PromptLookupDrafter
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.scheduler import ContinuousBatcher, GenerationRequest
from pipeline.decoding.stats import GenerationStats
from pipeline.decoding.step_cost import StepCost
from pipeline.decoding.stopping import SentenceEnds, SentenceStop, end_on_sentence, eos_token_ids
from pipeline.errors import ConfigError
from pipeline.knapspec.baselines import ClaspDrafter, EarlyExitDrafter, SwiftDrafter
from pipeline.knapspec.batch_plan import BatchPlanner
from pipeline.knapspec.drafter import KnapSpecDrafter
from pipeline.knapspec.hybrid import KnapSpecLookupDrafter
from pipeline.knapspec.latency import LatencyModel
from pipeline.knapspec.replanning import KnapSpecConfig, SearchHistory
from pipeline.model import checkpoint
from pipeline.model.linear import KERNEL_MAX_ROWS, ComputeMode, resolve_compute_mode
from pipeline.model.sublayer_model import SublayerModel

logger = logging.getLogger(__name__)

# (model, model name, force) -> the model's latency table on this device; `force` re-measures.
# Built by whoever owns calibration (profiling.calibration.store_calibrator): the engine
# only asks for a table when a searching strategy first needs one. A calibrator may also
# `record(model, model name, step cost, steps)`: the fit of the engine's timed batch steps,
# kept with the table for the next engine (StoreCalibrator does).
Calibrator = Callable[[SublayerModel, str, bool], LatencyModel]


@dataclass(frozen=True)
class Strategy:
    """A decoding strategy: how to build its drafter for a request, and its defaults."""

    description: str
    max_draft: int  # longest draft per step unless the caller says otherwise
    # (engine, strategy config) -> the request's drafter; None: transformers generate() decodes.
    build: Callable[[Engine, StrategyConfig], Drafter] | None
    searching: bool = False  # plans its drafts from the latency model (needs a calibration)


def _static(engine: Engine, strategy: StrategyConfig) -> Drafter:
    spec = engine.model.spec
    skip = strategy.skip if strategy.skip is not None else default_static_skip(spec.num_layers)
    return LayerSkipDrafter(skip, spec.num_items, max_draft=strategy.max_draft)


def _knapspec(coupled: bool) -> Callable[[Engine, StrategyConfig], Drafter]:
    def build(engine: Engine, strategy: StrategyConfig) -> Drafter:
        config = KnapSpecConfig(max_draft=strategy.max_draft, coupled=coupled)
        name = strategy.name
        return KnapSpecDrafter(engine.latency, config, engine.search_history(name), engine.batch_planner(name, config))

    return build


def _knapspec_lookup(engine: Engine, strategy: StrategyConfig) -> Drafter:
    config = KnapSpecConfig(max_draft=strategy.max_draft)
    history, planner = engine.search_history(strategy.name), engine.batch_planner(strategy.name, config)
    return KnapSpecLookupDrafter(engine.latency, config, PromptLookupDrafter(), history, planner)


def _baseline(cls: type) -> Callable[[Engine, StrategyConfig], Drafter]:
    def build(engine: Engine, strategy: StrategyConfig) -> Drafter:
        return cls(engine.latency, KnapSpecConfig(max_draft=strategy.max_draft))

    return build


# Copied drafts: 3 tokens measured better than the layer-skip default of 4 on CPU (see
# prompt_lookup.py); the searching strategies choose γ themselves up to D.
_SEARCH_MAX_DRAFT = KnapSpecConfig.max_draft
REGISTRY: dict[str, Strategy] = {
    "hf": Strategy("transformers generate(), the outside reference", DEFAULT_MAX_DRAFT, None),
    "ar": Strategy("our sublayer runner, plain autoregressive decoding", DEFAULT_MAX_DRAFT, lambda e, s: NoDraft()),
    "static": Strategy("self-speculative decoding with a fixed set of skipped items", DEFAULT_MAX_DRAFT, _static),
    "lookup": Strategy(
        "drafts copied from the context (prompt lookup)",
        DEFAULT_LOOKUP_MAX_DRAFT,
        lambda e, s: PromptLookupDrafter(max_draft=s.max_draft),
    ),
    "hf-lookup": Strategy("transformers generate() with its own prompt lookup", DEFAULT_LOOKUP_MAX_DRAFT, None),
    "knapspec": Strategy(
        "the latency-aware knapsack over sublayers, TPT over γ, AR fallback", _SEARCH_MAX_DRAFT, _knapspec(False), True
    ),
    "knapspec-coupled": Strategy(
        "KnapSpec with a layer's attention and MLP skipped together (ablation)",
        _SEARCH_MAX_DRAFT,
        _knapspec(True),
        True,
    ),
    "clasp": Strategy(
        "CLaSp: layer-granular cosine DP, latency-blind", _SEARCH_MAX_DRAFT, _baseline(ClaspDrafter), True
    ),
    "swift": Strategy("SWIFT: on-the-fly search of skipped layers", _SEARCH_MAX_DRAFT, _baseline(SwiftDrafter), True),
    "early-exit": Strategy(
        "the first layers only, the best exit depth", _SEARCH_MAX_DRAFT, _baseline(EarlyExitDrafter), True
    ),
    "knapspec-lookup": Strategy(
        "KnapSpec plus prompt-lookup drafts in the same TPT search", _SEARCH_MAX_DRAFT, _knapspec_lookup, True
    ),
}
STRATEGIES = tuple(REGISTRY)
# Requests a replica decodes together unless told otherwise (docs/speed.md, "Batches").
DEFAULT_MAX_BATCH = 8
SEARCHING_STRATEGIES = tuple(name for name, strategy in REGISTRY.items() if strategy.searching)


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
    # What a batch's KV caches may take together; None: `max_batch` caches at the whole context.
    kv_cache_bytes: int | None = None


@dataclass(frozen=True)
class StrategyConfig:
    name: str = "ar"
    skip: tuple[int, ...] | None = None  # items skipped by `static`; None for the default set
    max_draft: int | None = None  # None: the strategy's default (REGISTRY)

    def __post_init__(self) -> None:
        if self.name not in REGISTRY:
            raise ConfigError(f"unknown strategy {self.name!r}; choose one of {', '.join(STRATEGIES)}")
        if self.max_draft is None:
            object.__setattr__(self, "max_draft", REGISTRY[self.name].max_draft)
        if self.max_draft >= KERNEL_MAX_ROWS:  # a verify of the draft and one more token
            raise ConfigError(
                f"max_draft {self.max_draft} is too long: drafts of up to {KERNEL_MAX_ROWS - 1} tokens keep a verify "
                "within the kernels that round each row as it rounds alone (pipeline/model/precision.py)"
            )


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
            model = SublayerModel.from_tensors(
                self.hf_config, checkpoint.read_tensors(self.path), self.mode, self.device
            )
        self.model = model
        self.eos_token_ids = eos_token_ids(self.path, self.hf_config, self.tokenizer)
        self.sentences = SentenceEnds(self.tokenizer)
        self._hf_model = None
        self._latency = config.latency
        self._calibrator = calibrator
        # Per strategy: what earlier requests' searches concluded on this model and device.
        self._search_history = {name: SearchHistory() for name in SEARCHING_STRATEGIES}
        self._batch_planners: dict[tuple[str, KnapSpecConfig], BatchPlanner] = {}
        self._calibrated = False  # the latency table came from the calibrator (its corrections are ours to record)
        self._step_cost = DeviceStepCost(self._record_step_cost)
        logger.info("Loaded %s (%d layers) in %s mode", self.path.name, self.model.spec.num_layers, self.mode.value)

    @property
    def name(self) -> str:
        return checkpoint.EMBEDDED_MODEL if self.config.model is None else str(self.config.model)

    @property
    def hf_model(self):
        if self._hf_model is None:
            model = checkpoint.load_hf_model(self.path).to(self.device)
            self._hf_model = prepare_hf_model(model, self.mode)
        return self._hf_model

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
        record = getattr(self._calibrator, "record", None)
        if record is None or not self._calibrated:
            return  # a table given in the config: the store holds nothing of it to correct
        try:
            if record(self.model, self.name, cost, steps):
                logger.info("kept the fit of %d timed steps with this device's latency table", steps)
        except OSError as e:
            logger.warning("could not keep the step-cost fit with the latency table: %s", e)

    def search_history(self, strategy: str) -> SearchHistory:
        """What earlier requests of `strategy` on this engine concluded (shared by its drafters)."""
        return self._search_history[strategy]

    def batch_planner(self, strategy: str, config: KnapSpecConfig) -> BatchPlanner:
        """The planner of `strategy`'s requests inside a batch: one sub-network for all of them
        (knapspec/batch_plan.py). One per strategy and configuration: a replica runs one batch
        at a time (a pipelined replica's lanes plan per request: its DP runs stage by stage)."""
        key = (strategy, config)
        if key not in self._batch_planners:
            self._batch_planners[key] = BatchPlanner(self.latency, config, self.search_history(strategy))
        return self._batch_planners[key]

    def batch_searches(self, strategy: str) -> list[dict]:
        """What `strategy`'s batch planners chose and predicted, search by search, oldest first
        (the last knapspec.batch_plan.SEARCHES_KEPT of each planner)."""
        return [s for (name, _), planner in self._batch_planners.items() if name == strategy for s in planner.searches]

    def num_batch_searches(self, strategy: str) -> int:
        """How many batch searches `strategy`'s planners have made, kept or not."""
        return sum(planner.num_searches for (name, _), planner in self._batch_planners.items() if name == strategy)

    def num_batch_postponed(self, strategy: str) -> int:
        """How many of `strategy`'s batch checks found no time for a search within its share."""
        return sum(planner.num_postponed for (name, _), planner in self._batch_planners.items() if name == strategy)

    def drafter(self, strategy: StrategyConfig) -> Drafter:
        build = REGISTRY[strategy.name].build
        # transformers generate() drafts by itself: nothing of ours proposes.
        return NoDraft() if build is None else build(self, strategy)

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
        if REGISTRY[strategy.name].build is None:
            raise ConfigError(f"strategy {strategy.name!r} is transformers' generate(): it batches by itself")
        return GenerationRequest(prompt_ids, self.decode_config(max_new_tokens, params), params, self.drafter(strategy))

    def decode_config(self, max_new_tokens: int, params: SamplingParams) -> DecodeConfig:
        """Where a request's answer ends: EOS, the budget, and the sentence rule if `params` ask."""
        after = params.end_on_sentence_after
        return DecodeConfig(
            max_new_tokens, self.eos_token_ids, None if after is None else SentenceStop(self.sentences, after)
        )

    def batcher(self, max_batch: int) -> ContinuousBatcher:
        """A continuous batcher over this engine's model (`submit` the engine's `request`s). A
        whole model's batchers run one at a time and share one fit of the device's step cost; a
        pipelined replica's lanes step concurrently and fit their own."""
        budget = self._step_cost.budget() if isinstance(self.model, SublayerModel) else None
        return ContinuousBatcher(self.model, max_batch, self.config.kv_cache_bytes, budget=budget)

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
        if REGISTRY[strategy.name].build is None:
            return self._generate_hf_batches(prompts, strategy, max_new_tokens, per_request, max_batch)
        batcher = self.batcher(max_batch)
        tickets = [batcher.submit(self.request(p, strategy, max_new_tokens, q)) for p, q in zip(prompts, per_request)]
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
        """Generate after `prompt_ids` (1-D). `prefilled` reuses a prefilled cache (consumed)."""
        config = self.decode_config(max_new_tokens, params)
        self._check_context(prompt_ids, max_new_tokens)
        if REGISTRY[strategy.name].build is None:
            return self._generate_hf(prompt_ids, config, params, strategy)
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
        if any(q != params[0] for q in params):
            raise ConfigError("a generate() batch samples with one setting for all its prompts")
        for prompt in prompts:
            self._check_context(prompt, max_new_tokens)
        results = []
        for at in range(0, len(prompts), max_batch):
            batch = prompts[at : at + max_batch]
            runs = run_hf_generate_batch(
                self.hf_model, batch, max_new_tokens, self.eos_token_ids, params[0], self.tokenizer.pad_token_id
            )
            config = self.decode_config(max_new_tokens, params[0])
            results += [self._hf_result(prompt, run, config) for prompt, run in zip(batch, runs)]
        return results

    def _generate_hf(
        self, prompt_ids: torch.Tensor, config: DecodeConfig, params: SamplingParams, strategy: StrategyConfig
    ) -> GenerationResult:
        lookup = strategy.name == "hf-lookup"
        run = run_hf_generate(
            self.hf_model,
            prompt_ids,
            config.max_new_tokens,
            config.eos_token_ids,
            params,
            self.tokenizer.pad_token_id,
            prompt_lookup_num_tokens=strategy.max_draft if lookup else None,
            max_matching_ngram_size=DEFAULT_MAX_NGRAM if lookup else None,
        )
        return self._hf_result(prompt_ids, run, config)

    def _hf_result(self, prompt_ids: torch.Tensor, run: HFRun, config: DecodeConfig) -> GenerationResult:
        # generate() stops at EOS and the budget only: the sentence rule applies to its stream after.
        token_ids, finish = end_on_sentence(run.token_ids, config.max_new_tokens, config.eos_token_ids, config.stop)
        # generate() does not say how many tokens it drafted, only how many forwards it
        # ran; tokens beyond one per forward were accepted drafts. In a batch the forwards
        # are the batch's: a request that ended early ran fewer.
        stats = GenerationStats(
            prompt_tokens=prompt_ids.numel(),
            output_tokens=len(token_ids),
            steps=min(run.num_forwards, max(len(token_ids) - 1, 0)),
            accepted_tokens=max(len(token_ids) - 1 - run.num_forwards, 0),
            prefill_s=run.prefill_s,
            decode_s=run.decode_s,
        )
        return GenerationResult(token_ids=token_ids, stats=stats, finish_reason=finish)
