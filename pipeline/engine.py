"""One model replica in one process: load once, generate with any strategy.

Strategies:
- `hf`: transformers `generate()`, the outside reference;
- `ar`: our sublayer runner, plain autoregressive decoding;
- `static`: self-speculative decoding with a fixed set of skipped items.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline import checkpoint
from pipeline.decoding import DecodeConfig, GenerationResult, GenerationStats, Prefilled, decode, prefill
from pipeline.drafters import DEFAULT_MAX_DRAFT, Drafter, LayerSkipDrafter, NoDraft, default_static_skip
from pipeline.errors import ConfigError
from pipeline.hf_reference import hf_generate, prepare_hf_model
from pipeline.linear import ComputeMode, resolve_compute_mode
from pipeline.sampling import SamplingParams
from pipeline.sublayer_model import SublayerModel

logger = logging.getLogger(__name__)

STRATEGIES = ("hf", "ar", "static")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # a checkpoint folder; None for the embedded model
    dtype: str = "auto"
    device: str = "cpu"
    cache_dir: Path | None = None


@dataclass(frozen=True)
class StrategyConfig:
    name: str = "ar"
    skip: tuple[int, ...] | None = None  # items skipped by `static`; None for the default set
    max_draft: int = DEFAULT_MAX_DRAFT

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES:
            raise ConfigError(f"unknown strategy {self.name!r}; choose one of {', '.join(STRATEGIES)}")


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.mode: ComputeMode = resolve_compute_mode(config.dtype, self.device)
        self.path = checkpoint.resolve_checkpoint(config.model, config.cache_dir)
        self.hf_config = checkpoint.load_config(self.path)
        self.tokenizer = checkpoint.load_tokenizer(self.path)
        tensors = checkpoint.read_tensors(self.path)
        self.model = SublayerModel.from_tensors(self.hf_config, tensors, self.mode, self.device)
        self.eos_token_ids = _eos_token_ids(self.path, self.hf_config, self.tokenizer)
        self._hf_model = None
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

    def drafter(self, strategy: StrategyConfig) -> Drafter:
        if strategy.name == "static":
            skip = strategy.skip if strategy.skip is not None else default_static_skip(self.model.spec.num_layers)
            return LayerSkipDrafter(skip, self.model.spec.num_items, max_draft=strategy.max_draft)
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
        if strategy.name == "hf":
            return self._generate_hf(prompt_ids, config, params)
        drafter = self.drafter(strategy)
        if prefilled is None:
            prefilled = self.prefill(prompt_ids, max_new_tokens)
        return decode(self.model, prefilled, config, params, drafter)

    def _generate_hf(self, prompt_ids: torch.Tensor, config: DecodeConfig, params: SamplingParams) -> GenerationResult:
        token_ids, prefill_s, decode_s = hf_generate(
            self.hf_model, prompt_ids, config.max_new_tokens, config.eos_token_ids, params, self.tokenizer.pad_token_id
        )
        stats = GenerationStats(
            prompt_tokens=prompt_ids.numel(),
            output_tokens=len(token_ids),
            steps=max(len(token_ids) - 1, 0),
            prefill_s=prefill_s,
            decode_s=decode_s,
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
