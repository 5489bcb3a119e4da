"""One model replica in one process: load once, generate with any strategy.

Strategies:
- `hf`: transformers `generate()`, the outside reference;
- `ar`: our sublayer runner, plain autoregressive decoding;
- `static`: self-speculative decoding with a fixed set of skipped items;
- `lookup`: speculative decoding with drafts copied from the context (prompt lookup);
- `hf-lookup`: transformers `generate()` with its own prompt lookup, the outside reference for `lookup`;
- `knapspec`: the latency-aware knapsack over sublayers, TPT over γ, AR fallback;
- `knapspec-coupled`: the same with a layer's attention and MLP skipped together (ablation);
- `clasp`, `swift`, `early-exit`: self-speculative baselines (see baselines.py);
- `knapspec-lookup`: KnapSpec plus prompt-lookup drafts in the same TPT search.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.model import checkpoint
from pipeline.knapspec.baselines import ClaspDrafter, EarlyExitDrafter, SwiftDrafter
from pipeline.decoding.loop import DecodeConfig, GenerationResult, GenerationStats, Prefilled, decode, prefill
from pipeline.decoding.drafters import DEFAULT_MAX_DRAFT, Drafter, LayerSkipDrafter, NoDraft, default_static_skip
from pipeline.errors import ConfigError
from pipeline.decoding.hf_reference import prepare_hf_model, run_hf_generate
from pipeline.knapspec.hybrid import KnapSpecLookupDrafter
from pipeline.knapspec.drafter import KnapSpecConfig, KnapSpecDrafter, SearchHistory
from pipeline.knapspec.latency import LatencyModel
from pipeline.model.linear import ComputeMode, resolve_compute_mode
from pipeline.decoding.prompt_lookup import DEFAULT_LOOKUP_MAX_DRAFT, DEFAULT_MAX_NGRAM, PromptLookupDrafter
from pipeline.decoding.sampling import SamplingParams
from pipeline.model.sublayer_model import SublayerModel

logger = logging.getLogger(__name__)

SEARCHING_STRATEGIES = ("knapspec", "knapspec-coupled", "clasp", "swift", "early-exit", "knapspec-lookup")
STRATEGIES = ("hf", "ar", "static", "lookup", "hf-lookup", *SEARCHING_STRATEGIES)
# Copied drafts: 3 tokens measured better than the layer-skip default of 4 on CPU (see prompt_lookup.py);
# the searching strategies choose γ themselves up to D (KnapSpecConfig.max_draft).
_DEFAULT_MAX_DRAFTS = {
    "lookup": DEFAULT_LOOKUP_MAX_DRAFT,
    "hf-lookup": DEFAULT_LOOKUP_MAX_DRAFT,
    **{name: KnapSpecConfig.max_draft for name in SEARCHING_STRATEGIES},
}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # a checkpoint folder; None for the embedded model
    dtype: str = "auto"
    device: str = "cpu"
    cache_dir: Path | None = None
    # The latency model of the searching strategies (a LatencyModel, or a PipelineLatency
    # of stage tables); None: this device's calibration from the store (measured on first
    # use, about ten seconds for a small model).
    latency: LatencyModel | None = None
    calibration_dir: Path | None = None


@dataclass(frozen=True)
class StrategyConfig:
    name: str = "ar"
    skip: tuple[int, ...] | None = None  # items skipped by `static`; None for the default set
    max_draft: int | None = None  # None: the strategy's default (3 for the lookups, else 4)

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES:
            raise ConfigError(f"unknown strategy {self.name!r}; choose one of {', '.join(STRATEGIES)}")
        if self.max_draft is None:
            object.__setattr__(self, "max_draft", _DEFAULT_MAX_DRAFTS.get(self.name, DEFAULT_MAX_DRAFT))


class Engine:
    def __init__(self, config: EngineConfig, model=None) -> None:
        """`model`: an already built model of `config.model` with the SublayerModel interface
        (a PipelineModel over stage actors); None loads the whole model in this process."""
        self.config = config
        self.device = torch.device(config.device)
        self.mode: ComputeMode = resolve_compute_mode(config.dtype, self.device)
        self.path = checkpoint.resolve_checkpoint(config.model, config.cache_dir)
        self.hf_config = checkpoint.load_config(self.path)
        self.tokenizer = checkpoint.load_tokenizer(self.path)
        if model is None:
            model = SublayerModel.from_tensors(self.hf_config, checkpoint.read_tensors(self.path), self.mode, self.device)
        self.model = model
        self.eos_token_ids = _eos_token_ids(self.path, self.hf_config, self.tokenizer)
        self._hf_model = None
        self._latency = config.latency
        # Per strategy: what earlier requests' searches concluded on this model and device.
        self._search_history = {name: SearchHistory() for name in SEARCHING_STRATEGIES}
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
        """The stored calibration of this model on this device, measured (and stored) when
        there is none or when `force`: a machine whose load changed re-measures."""
        # profiling builds on pipeline; imported here so that pipeline imports without it.
        from profiling.calibration import CalibrationKey, CalibrationStore

        store = CalibrationStore(self.config.calibration_dir)
        if not isinstance(self.model, SublayerModel):
            # A sharded model is timed by its stages, on their devices (PipelineModel.calibrate).
            raise ConfigError("this engine's model runs elsewhere: pass its latency model in EngineConfig(latency=...)")
        key = CalibrationKey.for_model(self.model, self.name)
        self._latency = store.load_or_measure(self.model, key, force=force).latency
        return self._latency

    def drafter(self, strategy: StrategyConfig) -> Drafter:
        if strategy.name == "static":
            skip = strategy.skip if strategy.skip is not None else default_static_skip(self.model.spec.num_layers)
            return LayerSkipDrafter(skip, self.model.spec.num_items, max_draft=strategy.max_draft)
        if strategy.name == "lookup":
            return PromptLookupDrafter(max_draft=strategy.max_draft)
        if strategy.name in SEARCHING_STRATEGIES:
            config = KnapSpecConfig(max_draft=strategy.max_draft, coupled=strategy.name == "knapspec-coupled")
            history = self._search_history[strategy.name]
            if strategy.name in ("knapspec", "knapspec-coupled"):
                return KnapSpecDrafter(self.latency, config, history)
            if strategy.name == "knapspec-lookup":
                return KnapSpecLookupDrafter(self.latency, config, PromptLookupDrafter(), history)
            return {"clasp": ClaspDrafter, "swift": SwiftDrafter, "early-exit": EarlyExitDrafter}[strategy.name](
                self.latency, config
            )
        return NoDraft()

    def prefill(self, prompt_ids: torch.Tensor, max_new_tokens: int) -> Prefilled:
        return prefill(self.model, prompt_ids, max_new_tokens)

    def generate(
        self,
        prompt_ids: torch.Tensor,
        strategy: StrategyConfig,
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        prefilled: Prefilled | None = None,
    ) -> GenerationResult:
        """Generate after `prompt_ids` (1-D). `prefilled` reuses a prefilled cache (consumed)."""
        config = DecodeConfig(max_new_tokens=max_new_tokens, eos_token_ids=self.eos_token_ids)
        if prompt_ids.numel() + max_new_tokens > self.model.max_context:
            raise ConfigError(
                f"{prompt_ids.numel()} prompt tokens + {max_new_tokens} new tokens exceed this model's "
                f"{self.model.max_context}-token context; shorten the prompt or lower max_new_tokens"
            )
        if strategy.name in ("hf", "hf-lookup"):
            return self._generate_hf(prompt_ids, config, params, strategy)
        drafter = self.drafter(strategy)
        if prefilled is None:
            prefilled = self.prefill(prompt_ids, max_new_tokens)
        return decode(self.model, prefilled, config, params, drafter, prompt_ids.tolist())

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
        token_ids = run.token_ids
        # generate() does not say how many tokens it drafted, only how many forwards it
        # ran; tokens beyond one per forward were accepted drafts.
        stats = GenerationStats(
            prompt_tokens=prompt_ids.numel(),
            output_tokens=len(token_ids),
            steps=run.num_forwards,
            accepted_tokens=max(len(token_ids) - 1 - run.num_forwards, 0),
            prefill_s=run.prefill_s,
            decode_s=run.decode_s,
        )
        finish = "eos" if token_ids and token_ids[-1] in config.eos_token_ids else "length"
        return GenerationResult(token_ids=token_ids, stats=stats, finish_reason=finish)


def _eos_token_ids(path: Path, hf_config, tokenizer) -> frozenset[int]:
    """End-of-sequence ids: generation_config.json first (chat models often list several
    there, e.g. Llama 3.1's <|eot_id|>), then config.json, then the tokenizer."""
    candidates = []
    if (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        candidates.append(GenerationConfig.from_pretrained(path).eos_token_id)
    candidates += [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    ids = next((c for c in candidates if c is not None), None)
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)
