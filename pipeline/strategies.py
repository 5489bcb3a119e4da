"""The decoding strategies: a registry of how each builds a request's drafter, and its defaults.

Plain decoding, a fixed skip set, prompt lookup, KnapSpec and its hybrid, the baselines, and
transformers' `generate()` as the outside reference. `DrafterFactory` builds a request's drafter of
a strategy and holds what a strategy's drafters share on one engine: what earlier searches
concluded, and the planner of their batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.decoding.drafters import DEFAULT_MAX_DRAFT, Drafter, LayerSkipDrafter, NoDraft, default_static_skip
from pipeline.decoding.prompt_lookup import DEFAULT_LOOKUP_MAX_DRAFT, PromptLookupDrafter
from pipeline.errors import ConfigError
from pipeline.knapspec.baselines import ClaspDrafter, EarlyExitDrafter, SwiftDrafter
from pipeline.knapspec.batch_plan import BatchPlanner
from pipeline.knapspec.drafter import KnapSpecDrafter
from pipeline.knapspec.hybrid import KnapSpecLookupDrafter
from pipeline.knapspec.latency import LatencyModel
from pipeline.knapspec.replanning import KnapSpecConfig, SearchHistory
from pipeline.model.linear import KERNEL_MAX_ROWS
from pipeline.model.spec import ModelSpec


@dataclass(frozen=True)
class Strategy:
    """A decoding strategy: how to build its drafter for a request, and its defaults."""

    description: str
    max_draft: int  # longest draft per step unless the caller says otherwise
    # (drafters, strategy config) -> the request's drafter; None: transformers generate() decodes.
    build: Callable[[DrafterFactory, StrategyConfig], Drafter] | None
    searching: bool = False  # plans its drafts from the latency model (needs a calibration)


def _static(drafters: DrafterFactory, strategy: StrategyConfig) -> Drafter:
    spec = drafters.spec
    skip = strategy.skip if strategy.skip is not None else default_static_skip(spec.num_layers)
    return LayerSkipDrafter(skip, spec.num_items, max_draft=strategy.max_draft)


def _knapspec(coupled: bool) -> Callable[[DrafterFactory, StrategyConfig], Drafter]:
    def build(drafters: DrafterFactory, strategy: StrategyConfig) -> Drafter:
        config = KnapSpecConfig(max_draft=strategy.max_draft, coupled=coupled)
        history, planner = drafters.history(strategy.name), drafters.planner(strategy.name, config)
        return KnapSpecDrafter(drafters.latency, config, history, planner)

    return build


def _knapspec_lookup(drafters: DrafterFactory, strategy: StrategyConfig) -> Drafter:
    config = KnapSpecConfig(max_draft=strategy.max_draft)
    history, planner = drafters.history(strategy.name), drafters.planner(strategy.name, config)
    return KnapSpecLookupDrafter(drafters.latency, config, PromptLookupDrafter(), history, planner)


def _baseline(cls: type) -> Callable[[DrafterFactory, StrategyConfig], Drafter]:
    def build(drafters: DrafterFactory, strategy: StrategyConfig) -> Drafter:
        return cls(drafters.latency, KnapSpecConfig(max_draft=strategy.max_draft))

    return build


# Copied drafts: 3 tokens measured better than the layer-skip default of 4 on CPU (see
# prompt_lookup.py); the searching strategies choose γ themselves up to D.
_SEARCH_MAX_DRAFT = KnapSpecConfig.max_draft
REGISTRY: dict[str, Strategy] = {
    "hf": Strategy("transformers generate(), the outside reference", DEFAULT_MAX_DRAFT, None),
    "ar": Strategy("our sublayer runner, plain autoregressive decoding", DEFAULT_MAX_DRAFT, lambda d, s: NoDraft()),
    "static": Strategy("self-speculative decoding with a fixed set of skipped items", DEFAULT_MAX_DRAFT, _static),
    "lookup": Strategy(
        "drafts copied from the context (prompt lookup)",
        DEFAULT_LOOKUP_MAX_DRAFT,
        lambda d, s: PromptLookupDrafter(max_draft=s.max_draft),
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
SEARCHING_STRATEGIES = tuple(name for name, strategy in REGISTRY.items() if strategy.searching)


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

    @property
    def ours(self) -> bool:
        """Whether our engine decodes it (else transformers' generate() does)."""
        return REGISTRY[self.name].build is not None


class DrafterFactory:
    """Each request's drafter of a strategy, for one engine's model. `latency` gives the
    searching strategies' latency model when one is first needed (calibrating, perhaps)."""

    def __init__(self, spec: ModelSpec, latency: Callable[[], LatencyModel]) -> None:
        self.spec = spec
        self._latency = latency
        # Per strategy: what earlier requests' searches concluded on this model and device.
        self._histories = {name: SearchHistory() for name in SEARCHING_STRATEGIES}
        self._planners: dict[tuple[str, KnapSpecConfig], BatchPlanner] = {}

    @property
    def latency(self) -> LatencyModel:
        return self._latency()

    def build(self, strategy: StrategyConfig) -> Drafter:
        build = REGISTRY[strategy.name].build
        # transformers generate() drafts by itself: nothing of ours proposes.
        return NoDraft() if build is None else build(self, strategy)

    def history(self, strategy: str) -> SearchHistory:
        """What earlier requests of `strategy` on this engine concluded (shared by its drafters)."""
        return self._histories[strategy]

    def planner(self, strategy: str, config: KnapSpecConfig) -> BatchPlanner:
        """The planner of `strategy`'s requests inside a batch: one sub-network for all of them
        (knapspec/batch_plan.py). One per strategy and configuration: a replica runs one batch
        at a time (a pipelined replica's lanes plan per request: its DP runs stage by stage)."""
        key = (strategy, config)
        if key not in self._planners:
            self._planners[key] = BatchPlanner(self.latency, config, self.history(strategy))
        return self._planners[key]
