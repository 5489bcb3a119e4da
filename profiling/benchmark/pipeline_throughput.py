"""A pipelined replica's throughput: tokens/s of one replica of P stage actors with 1 vs k
requests in flight (interleaved, repeated, medians), and the median round trip of one hidden
state to a stage actor. The job keeps Ray on 127.0.0.1 before this imports it."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from pipeline.decoding.sampling import SamplingParams
from pipeline.engine import EngineConfig, StrategyConfig
from pipeline.summarization.prompts import build_prompt
from profiling.benchmark.settings import PipelineSettings


def pipeline_throughput(settings: PipelineSettings, texts: list[str]) -> tuple[list[dict], float]:
    """One row per number of requests in flight, and one hop's median milliseconds. The
    requests' prompts are cut from `texts` in turn, each from a later place."""
    from concurrent.futures import ThreadPoolExecutor

    import ray

    from actors.replica import PipelineReplica

    stages = settings.stages
    in_flight = list(settings.in_flight)
    length = settings.context_tokens
    name, dtype, max_new_tokens = settings.strategy, settings.dtype, settings.max_new_tokens
    ray.init(address="local", include_dashboard=False)
    try:
        from pipeline.model import checkpoint

        engine_config = EngineConfig(model=settings.model, dtype=dtype, calibration_dir=settings.calibration_dir)
        path = checkpoint.resolve_checkpoint(settings.model)
        tokenizer = checkpoint.load_tokenizer(path)
        prompts = [
            build_prompt(tokenizer, texts[i % len(texts)][i * 500 :], length).token_ids.tolist()
            for i in range(settings.requests)
        ]
        threads = max(1, (os.cpu_count() or 1) // stages)
        replica = (
            ray.remote(PipelineReplica)
            .options(num_cpus=0, max_concurrency=max(in_flight))
            .remote(engine_config, StrategyConfig(name), stages, 0.5, threads)
        )
        ray.get(replica.info.remote())
        params = SamplingParams()

        def run(k: int) -> float:
            started = time.perf_counter()
            with ThreadPoolExecutor(k) as pool:
                outs = list(
                    pool.map(lambda ids: ray.get(replica.generate.remote(ids, max_new_tokens, params)), prompts)
                )
            return sum(len(o["token_ids"]) for o in outs) / (time.perf_counter() - started)

        run(1)  # warm-up: first calls load kernels on every stage
        rates: dict[int, list[float]] = {k: [] for k in in_flight}
        for _ in range(settings.repeats):
            for k in in_flight:
                rates[k].append(run(k))
        stage = ray.get(replica.stage_handles.remote())[-1]
        hidden = torch.zeros(1, checkpoint.load_config(path).hidden_size)
        hops = []
        for _ in range(50):
            started = time.perf_counter()
            ray.get(stage.echo.remote(hidden))
            hops.append(time.perf_counter() - started)
    finally:
        ray.shutdown()
    base = statistics.median(rates[in_flight[0]])
    rows = [
        {
            "pipeline_parallel": stages,
            "in_flight": k,
            "tokens_per_s": statistics.median(v),
            "vs_first": statistics.median(v) / base,
            "repeats": len(v),
        }
        for k, v in rates.items()
    ]
    return rows, statistics.median(hops) * 1e3


def write_pipeline_report(settings: PipelineSettings, rows: list[dict], hop_ms: float, output: Path) -> str:
    """Write OUTPUT/pipeline_benchmark.json; the table to print."""
    output.mkdir(parents=True, exist_ok=True)
    (output / "pipeline_benchmark.json").write_text(json.dumps({"rows": rows, "hop_ms": hop_ms}, indent=2))
    lines = [
        f"| stages | requests in flight | tokens/s (prefill + decode) | vs {settings.in_flight[0]} in flight |",
        "|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {settings.stages} | {row['in_flight']} | {row['tokens_per_s']:.1f} | {row['vs_first']:.2f} |")
    lines.append(f"\nOne hop (a hidden state to a stage actor and back), median of 50: {hop_ms:.2f} ms")
    return "\n".join(lines)
