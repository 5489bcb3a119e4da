"""Microbenchmarks that calibrate KnapSpec's latency model on the device running the layers.

What is timed is what decoding runs: one token through an attention item at several
context lengths, through an MLP item, through the embedding + final norm + LM head,
full forwards of k = 1..D+1 tokens (a verify), and the knapsack DP's rows on one and on
four branches of its reference tokens (what one search costs, relative to a forward).
A model whose steps are captured (pipeline/model/graphs, CUDA graphs) is timed as it runs
them: each item as the replay of its own captured piece, the embedding and head as theirs,
a verify as a captured step; the DP's rows run eagerly there too. Two choices keep the
numbers honest:

- Each sample sweeps one item kind over *every* layer in turn and divides by L. Timing
  one layer over and over would find its weights and KV rows in the CPU caches (or
  L2 on a GPU), which a real forward never does.
- The KV cache is filled with random values, not left at zeros, and the tasks are timed
  in interleaved rounds, so that noise hits all of them alike (see benchmark_interleaved).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import torch

from pipeline.errors import ConfigError
from pipeline.knapspec.latency import LatencyModel
from pipeline.model.graphs import Granularity, StepGraphs
from pipeline.model.items import attention_item, mlp_item
from pipeline.model.packing import RequestRows
from pipeline.model.sublayer_model import SublayerModel
from profiling.fit import fit_linear, relative_rms
from profiling.record import DEFAULT_LAYOUT, Calibration, device_name
from profiling.timer import benchmark_interleaved, timer_for

logger = logging.getLogger(__name__)

DEFAULT_CONTEXT_LENGTHS = (128, 512, 1024, 2048, 4096)
DEFAULT_MAX_VERIFY = 11  # D + 1 with the paper's D = 10 drafts
DEFAULT_REPEATS = 5
# A search's rows run B branches of r reference tokens: timed at r = 12 with B = 1 and 4.
SEARCH_REFERENCE_TOKENS = 12
SEARCH_BRANCH_TOKENS = (12, 48)  # B·r
# A fit residual above this is reported as a suspect calibration.
SUSPECT_RESIDUAL = 0.25


def measure(
    model: SublayerModel,
    context_lengths: Sequence[int] = DEFAULT_CONTEXT_LENGTHS,
    max_verify: int = DEFAULT_MAX_VERIFY,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = 1,
    reference_context: int | None = None,
    model_name: str = "unknown",
    layout: str = DEFAULT_LAYOUT,
    seed: int = 0,
) -> Calibration:
    """Time `model`'s items on its device and fit its LatencyModel.

    `reference_context` is where the verify forwards run (default: the middle context
    length); context lengths the model cannot hold are dropped with a warning.
    """
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    if max_verify < 1:
        raise ConfigError(f"max_verify must be >= 1, got {max_verify}")
    lengths = _usable_lengths(context_lengths, model.max_context)
    if reference_context is None:
        reference_context = lengths[len(lengths) // 2]
    # A verify at the reference context writes positions [ref, ref + max_verify); a search reads
    # the cache below it and runs its reference tokens on the positions above.
    reference_context = min(reference_context, model.max_context - max(max_verify, SEARCH_REFERENCE_TOKENS))
    if reference_context < 0:
        raise ConfigError(f"max_verify {max_verify} exceeds this model's {model.max_context}-token context")

    spec = model.spec
    num_layers = spec.num_layers
    device = model.device
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = model.new_cache(max(lengths[-1] + 1, reference_context + max_verify))
    # Random keys/values: zeros could take fast paths (or denormal slow paths) real caches never see.
    cache.keys.normal_(generator=generator)
    cache.values.normal_(generator=generator)
    h = torch.randn(1, spec.hidden_size, generator=generator, device=device).to(model.dtype)  # [1, d]
    token_ids = torch.randint(spec.vocab_size, (max_verify,), generator=generator, device=device)  # [max_verify]

    def eager_sweep(item_of: Callable[[int], int], n: int) -> Callable[[], None]:
        # The rows' set-up (positions, masks) made once, as a forward makes it once for all its items.
        rows = model.rows([(cache, n, 1)])

        # The same input for every layer: chaining outputs would let values drift over rounds.
        def run() -> None:
            for layer in range(num_layers):
                model.run_item(item_of(layer), h, rows)

        return run

    @torch.inference_mode()
    def eager_fixed() -> None:
        model.logits(model.embed_tokens(token_ids[:1]))

    def eager_verify(k: int) -> Callable[[], None]:
        return lambda: model.forward(cache, token_ids[:k], reference_context, logits="all")

    def search(branch_tokens: int) -> Callable[[], None]:
        # Every row of the DP on branch_tokens rows, reading the cache below the reference
        # tokens, then the LM head on every branch (how the candidates are scored).
        shape = (branch_tokens // SEARCH_REFERENCE_TOKENS, SEARCH_REFERENCE_TOKENS, spec.hidden_size)
        branches = torch.randn(shape, generator=generator, device=device).to(model.dtype)  # [B, r, d]

        @torch.inference_mode()
        def run() -> None:
            for item in range(spec.num_items):
                model.run_item_branches(item, branches, cache, reference_context)
            model.logits(branches.reshape(-1, spec.hidden_size))

        return run

    if model.graphs is not None:
        capacity = max(lengths[-1] + 1, reference_context + max_verify)
        captured = CapturedItems(model, capacity, reference_context, seed)
        sweep, verify, fixed = captured.sweep, captured.verify, captured.fixed
    else:
        sweep, verify, fixed = eager_sweep, eager_verify, eager_fixed
    tasks: dict[str, Callable[[], object]] = {f"attn@{n}": sweep(attention_item, n) for n in lengths}
    tasks["mlp"] = sweep(mlp_item, 0)
    tasks["fixed"] = fixed
    tasks.update({f"verify@{k}": verify(k) for k in range(1, max_verify + 1)})
    tasks.update({f"search@{m}": search(m) for m in SEARCH_BRANCH_TOKENS})
    logger.info(
        "calibrating %s (%s) on %s: contexts %s, verify of 1..%d tokens at %d, %d rounds",
        model_name,
        model.mode.value,
        device,
        ",".join(map(str, lengths)),
        max_verify,
        reference_context,
        warmup + repeats,
    )
    timings = benchmark_interleaved(tasks, timer_for(device), repeats=repeats, warmup=warmup)

    t_attn = [timings[f"attn@{n}"].median / num_layers for n in lengths]
    t_verify = [timings[f"verify@{k}"].median for k in range(1, max_verify + 1)]
    attn_fit = fit_linear(lengths, t_attn)
    # A search's cost in forwards at the reference context, as c0 + c1·m through the two sizes.
    t_search = [timings[f"search@{m}"].median / t_verify[0] for m in SEARCH_BRANCH_TOKENS]
    (m_small, m_large), (s_small, s_large) = SEARCH_BRANCH_TOKENS, t_search
    search_per_token = max(0.0, (s_large - s_small) / (m_large - m_small))
    search_base = max(0.0, s_small - search_per_token * m_small)
    latency = LatencyModel(
        attn_slope=attn_fit.slope,
        attn_base=attn_fit.intercept,
        t_mlp=timings["mlp"].median / num_layers,
        t_fixed=timings["fixed"].median,
        verify_ratios=verify_ratios(t_verify),
        num_layers=num_layers,
        search_base=search_base,
        search_per_token=search_per_token,
    )
    residuals = {
        "t_attn": attn_fit.residual,
        # The sum of the parts against a measured whole: what per-forward overhead the model misses.
        "t_forward": relative_rms([latency.t_forward(reference_context)], [t_verify[0]]),
    }
    logger.info(
        "fit residuals: attention %.1f%%, forward %.1f%%", 100 * residuals["t_attn"], 100 * residuals["t_forward"]
    )
    if max(residuals.values()) > SUSPECT_RESIDUAL:
        # On a quiet machine both stay within ~10%; far worse usually means another process
        # shared the cores (OpenMP threads then wait on each other) and the numbers are noise.
        logger.warning(
            "this calibration is inconsistent (attention fit off by %.0f%%, parts vs whole forward by %.0f%%): "
            "was the device busy? Re-measure when it is idle",
            100 * residuals["t_attn"],
            100 * residuals["t_forward"],
        )
    return Calibration(
        latency=latency,
        device=device_name(device),
        model=model_name,
        dtype=model.mode.value,
        layout=layout,
        num_threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        created_at=Calibration.now(),
        context_lengths=tuple(lengths),
        t_attn_measured=tuple(t_attn),
        reference_context=reference_context,
        t_verify_measured=tuple(t_verify),
        repeats=repeats,
        fit_residuals=residuals,
        attention=model.attention_route,
    )


class CapturedItems:
    """The microbenchmarks' tasks as a model with captured steps runs them: one request in a
    slot of its own pool (random keys and values), each item's piece, the embedding's and
    the head's replayed as a step replays them (graphs.Granularity.ITEMS: one piece per item),
    a verify as the model's own captured step."""

    def __init__(self, model: SublayerModel, capacity: int, reference_context: int, seed: int) -> None:
        generator = torch.Generator(device=model.device).manual_seed(seed + 1)
        self.model = model
        self.pool = model.new_pool(1, capacity)
        self.cache = self.pool.acquire(capacity)
        self.pool.keys.normal_(generator=generator)
        self.pool.values.normal_(generator=generator)
        settings = dataclasses.replace(model.graphs, granularity=Granularity.ITEMS)
        self.graphs = StepGraphs(model, self.pool, settings)
        self.steps = StepGraphs(model, self.pool, model.graphs)  # a whole step, as the model captures it
        self.num_layers = model.spec.num_layers
        self.reference_context = reference_context

    def _loaded(self, n: int, k: int = 1):
        self.cache.length = n
        blocks = [RequestRows(self.cache, list(range(10, 10 + k)), n)]
        bucket = self.graphs.bucket_of(blocks)
        return blocks, bucket

    def sweep(self, item_of: Callable[[int], int], n: int) -> Callable[[], None]:
        blocks, bucket = self._loaded(n)

        def run() -> None:  # one load, as a step has one for all its items
            step = self.graphs.load(bucket, blocks)
            for layer in range(self.num_layers):
                item = item_of(layer)
                self.graphs.replay(step, ((item, item + 1),))

        return run

    def fixed(self) -> None:
        blocks, bucket = self._loaded(0)
        step = self.graphs.load(bucket, blocks)
        self.graphs.replay(step, "embed")
        self.graphs.replay(step, "head")

    def verify(self, k: int) -> Callable[[], None]:
        blocks, bucket = self._loaded(self.reference_context, k)
        wanted = ["all"]
        return lambda: self.steps.run(bucket, blocks, (), wanted)


def verify_ratios(t_verify: Sequence[float]) -> tuple[float, ...]:
    """Cost of a forward of k tokens relative to one token, made non-decreasing in k.

    More tokens never do less work; a dip below an earlier ratio is noise, and a TPT
    search would chase it by drafting longer.
    """
    if not t_verify or t_verify[0] <= 0:
        raise ValueError(f"need a positive one-token forward time, got {list(t_verify[:1])}")
    ratios = [1.0]
    for t in t_verify[1:]:
        ratios.append(max(ratios[-1], t / t_verify[0]))
    return tuple(ratios)


def _usable_lengths(context_lengths: Sequence[int], max_context: int) -> list[int]:
    lengths = sorted({int(n) for n in context_lengths})
    if not lengths or lengths[0] < 0:
        raise ConfigError(f"context lengths must be non-negative and at least one, got {list(context_lengths)}")
    # Attention at context n writes the new token's keys at position n.
    usable = [n for n in lengths if n < max_context]
    if len(usable) < len(lengths):
        logger.warning(
            "skipping context lengths %s: this model holds at most %d tokens",
            ",".join(str(n) for n in lengths if n >= max_context),
            max_context,
        )
    if not usable:
        raise ConfigError(f"no context length below this model's {max_context}-token limit in {lengths}")
    return usable
