"""The strategy comparison: every (document, context length) decoded by every strategy in turn,
repeated, at every batch size, the order reversed on every other repeat so that a machine
growing busier or quieter hits all of them alike; and the verify costs beside them."""

from __future__ import annotations

import logging
import statistics

from pipeline.engine import SEARCHING_STRATEGIES
from profiling.benchmark.forced import forced_candidates
from profiling.benchmark.records import Comparison, Record, batch_record
from profiling.benchmark.runs import batch_prompts, build_engine, decode_alone, run_batch, run_order
from profiling.benchmark.settings import CONTROL, MATMUL, ComparisonSettings
from profiling.benchmark.verify_costs import batch_verify_costs, batch_verify_row, verify_costs, verify_row

logger = logging.getLogger(__name__)


def compare(settings: ComparisonSettings, documents: dict[str, str]) -> Comparison:
    """The records of every strategy on `documents` (id -> text), each against the reference in
    the same repeats, with the verify costs of the reference's mode."""
    pairs, reference, max_new_tokens = list(settings.pairs), settings.reference, settings.max_new_tokens
    engines = {
        dtype: build_engine(settings.model, dtype, settings.calibration_dir) for dtype in sorted({d for _, d in pairs})
    }
    tokenizer = next(iter(engines.values())).tokenizer
    if settings.recalibrate:
        for dtype in {d for n, d in pairs if n in SEARCHING_STRATEGIES}:
            engines[dtype].calibrate(force=True)

    params = settings.params
    batch_sizes = list(settings.batch_sizes)
    records: list[Record] = []
    verify_rows = []
    batch_verify = []
    forced: list[dict] = []
    for doc_id, text in documents.items():
        for length in settings.context_lengths:
            prompts = batch_prompts(tokenizer, text, length, max(batch_sizes))
            # One prefill per prompt and compute mode; every strategy and repeat decodes from its own copy.
            prefilled = {
                dtype: [engine.prefill(p, max_new_tokens) for p in prompts] for dtype, engine in engines.items()
            }
            alone = {
                dtype: [decode_alone(engine, p, f, max_new_tokens, params) for p, f in zip(prompts, prefilled[dtype])]
                for dtype, engine in engines.items()
            }
            reference_at_1 = None
            for size in batch_sizes:
                chosen = [pair for pair in pairs if size == 1 or pair[0] != "hf-lookup"]  # it takes one prompt
                runs: dict[tuple[str, str], list] = {pair: [] for pair in chosen}
                for repeat in range(settings.repeats):
                    for name, dtype in run_order(chosen, repeat):
                        strategy = reference[0] if name == CONTROL else name
                        run = run_batch(
                            engines[dtype], strategy, prompts[:size], prefilled[dtype][:size], max_new_tokens, params
                        )
                        runs[(name, dtype)].append(run)
                        logger.info(
                            "%s %d tokens, batch %d, %s:%s repeat %d: %.1f tok/s",
                            doc_id, prompts[0].numel(), size, name, dtype, repeat, run.tokens_per_s,
                        )  # fmt: skip
                ref_speeds = [r.tokens_per_s for r in runs[reference]]
                ref_full = [r.full_batch_tokens_per_s for r in runs[reference]]
                if size == batch_sizes[0]:
                    reference_at_1 = statistics.median(ref_speeds) if size == 1 else None
                for (name, dtype), batch_runs in runs.items():
                    records.append(
                        batch_record(
                            name, dtype, doc_id, size, batch_runs, ref_speeds, reference_at_1, alone[dtype], ref_full
                        )
                    )
                if size > 1:
                    costs = batch_verify_costs(engines[reference[1]], prompts[:size], prefilled[reference[1]][:size])
                    batch_verify.append(batch_verify_row(doc_id, prompts[0].numel(), size, costs))
            if settings.no_fallback:
                forced += forced_candidates(
                    engines[reference[1]], prompts[0], prefilled[reference[1]][0], doc_id, max_new_tokens,
                    settings.num_forced,
                )  # fmt: skip
            # The reference's mode, and beside it the same mode on the matmuls where that runs too.
            for dtype in [d for d in engines if d in (reference[1], f"{reference[1]}+{MATMUL}")]:
                verify_rows.append(
                    verify_row(doc_id, prompts[0].numel(), dtype, verify_costs(engines[dtype], prompts[0]))
                )
    return Comparison(records, verify_rows, batch_verify, forced)
