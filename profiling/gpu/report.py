"""The GPU check's report: one section per stage (a failed stage's error in its place), and
the issue's targets judged from what was measured."""

from __future__ import annotations

# What the captured step must reach at 4k context (docs/gpu.md): fractions of the bandwidth
# floor at batch 1 and 32, a draft's cost over its unskipped share of bytes, KnapSpec's
# predicted speed-up at batch 1.
FLOOR_TARGETS = {1: 0.8, 32: 0.85}
DRAFT_SLACK = 0.1
SPEEDUP_TARGET = 1.2
TARGET_CONTEXT = 4096


def _section(title: str, result, build) -> list[str]:
    """A stage's section; a failed stage's error, and what it measured before it failed."""
    if isinstance(result, dict) and "error" in result:
        partial = result.get("partial")
        return [f"## {title}", "", f"FAILED: {result['error']}", "", *(build(partial) if partial else []), ""]
    return [f"## {title}", "", *build(result), ""]


def _cell(row: dict, key: str) -> str:
    return f"{row[key]:.2f}" if key in row else "—"


def steps_lines(costs: list[dict], verify_rows: list[int]) -> list[str]:
    lines = [
        "| batch | context | eager ms | graphs ms | floor ms | floor / eager | floor / graphs | kernels eager | "
        "kernels graphs | launches eager | launches graphs | host ms eager | host ms graphs | "
        + " | ".join(f"verify {k} / 1" for k in verify_rows) + " |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(verify_rows),
    ]  # fmt: skip
    notes = []
    for row in costs:
        if "skipped" in row:
            lines.append(f"| {row['batch']} | {row['context']} | skipped: {row['skipped']} |")
            continue
        if "graphs_ms" not in row:
            lines.append(f"| {row['batch']} | {row['context']} | FAILED: {row.get('error', '?')} |")
            continue
        lines.append(
            f"| {row['batch']} | {row['context']} | {row['eager_ms']:.2f} | {row['graphs_ms']:.2f} "
            f"| {row['floor_ms']:.2f} | {row['eager_floor_over_step']:.2f} | {row['graphs_floor_over_step']:.2f} "
            f"| {row['eager_kernels']} | {row['graphs_kernels']} | {row['eager_launches']} | {row['graphs_launches']} "
            f"| {row['eager_host_ms']:.2f} | {row['graphs_host_ms']:.2f} | "
            + " | ".join(_cell(row, f"verify_{k}_over_1") for k in verify_rows) + " |"
        )  # fmt: skip
        if "error" in row:
            notes.append(f"- batch {row['batch']}, context {row['context']}: FAILED after its steps: {row['error']}")
        if "left" in row:
            notes.append(f"- batch {row['batch']}, context {row['context']}: {', '.join(row['left'])} left out of "
                         "the check's time")  # fmt: skip
    lines += ["", *notes] if notes else []
    lines += ["", "Capturing the steps above: graphs, host seconds, memory they hold (GPU)."]
    for row in costs:
        if "captures" in row:
            memory = f", {row['graphs_memory_mib']:.0f} MiB" if "graphs_memory_mib" in row else ""
            lines.append(f"- batch {row['batch']}, context {row['context']}: {row['captures']} graphs, "
                         f"{row['capture_s']:.1f} s{memory}")  # fmt: skip
    lines += [
        "",
        (
            "Drafts (captured): a sub-network skipping `attention/MLP` items, its step over the `ar` step, against "
            f"the share s of the step's bytes it skips; the target is at most (1 − s) + {DRAFT_SLACK}."
        ),
        "",
        "| batch | context | skipped items | bytes skipped | draft / ar | (1 − s) + 0.1 | within |",
        "|---:|---:|---|---:|---:|---:|---|",
    ]
    for row in costs:
        if "draft_over_ar" not in row:
            continue
        for key, ratio in sorted(row["draft_over_ar"].items(), key=lambda kv: row["draft_bytes_skipped"][kv[0]]):
            share = row["draft_bytes_skipped"][key]
            bound = 1 - share + DRAFT_SLACK
            lines.append(
                f"| {row['batch']} | {row['context']} | {key} | {share:.0%} | {ratio:.2f} | {bound:.2f} "
                f"| {'yes' if ratio <= bound else 'no'} |"
            )
    return lines


def variant_lines(costs: list[dict]) -> list[str]:
    rows = [row for row in costs if "variants" in row]
    if not rows:
        return []
    lines = [
        "",
        (
            f"Ways to capture a step: a graph per run of executed items, per item or per plan (skip set), with "
            f"FlexAttention or the masked matmuls, the element-wise work fused or not; the `ar` step and the draft "
            f"skipping "
            f"{rows[0]['variant_draft']} attention/MLP items, ms (captures made in brackets)."
        ),
        "",
        "| batch | context | " + " | ".join(f"{name}: ar / draft" for name in rows[0]["variants"]) + " |",
        "|---:|---:|" + "---|" * len(rows[0]["variants"]),
    ]
    for row in rows:
        cells = [f"{v['ar_ms']:.2f} / {v['draft_ms']:.2f} ({v['captures']})" for v in row["variants"].values()]
        lines.append(f"| {row['batch']} | {row['context']} | " + " | ".join(cells) + " |")
    return lines


def attention_lines(result: dict) -> list[str]:
    verdict = "PASS" if not result["failures"] else "FAIL"
    parts = [f"{name.replace('_', ' ')}: {result[name]:.2e}" for name in ("split_vs_masked", "flex_vs_matmul")
             if name in result]  # fmt: skip
    lines = [f"Attention routes in bf16 against their masked references, largest error over the largest: {verdict} — "
             + "; ".join(parts) + "."]  # fmt: skip
    return lines + [f"- {failure}" for failure in result["failures"]]


def knapspec_lines(plans: list[dict], acceptance: dict) -> list[str]:
    lines = [
        (
            "KnapSpec's predicted speed-up over `ar` at the same batch: this model's captured draft and verify "
            f"steps, with the α that drafts skipping the same shares of items reached on {acceptance.get('model', '?')}"
            f" ({acceptance.get('dtype', '?')}, {acceptance.get('context_length', '?')}-token prompts, "
            f"{len(acceptance.get('documents', []))} documents; jobs/acceptance.py). Random weights have no "
            "meaningful acceptance: these are predictions from measured step times and borrowed α, not measured "
            "speed-ups. γ is searched over the verify widths timed; AR where no draft wins."
        ),
        "",
        "| batch | context | best draft | attention skipped | MLP skipped | α | draft / ar step | γ | predicted speed-up |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for plan in plans:
        if plan["gamma"] == 0:
            lines.append(f"| {plan['batch']} | {plan['context']} | AR | — | — | — | — | — | 1.00× |")
            continue
        lines.append(
            f"| {plan['batch']} | {plan['context']} | {plan['kind']} | {plan['attention_skipped']:.0%} "
            f"| {plan['mlp_skipped']:.0%} | {plan['alpha']:.2f} | {plan['draft_over_ar']:.2f} | {plan['gamma']} "
            f"| {plan['speedup']:.2f}× |"
        )
    return lines


def prefill_lines(result: dict) -> list[str]:
    return [
        (
            f"{result['tokens']} prompt tokens in chunks of {result['chunk']}: {result['tokens_per_s']:.0f} tokens/s, "
            f"{result['tflops']:.3g} TFLOP/s, {result['of_peak']:.2f} of the matmul peak at the model's shapes "
            f"({result['peak_tflops']:.3g} TFLOP/s, same run)."
        )
    ] + captured_prefill_lines(result.get("captured"))


def captured_prefill_lines(captured: dict | None) -> list[str]:
    if captured is None:
        return []
    if "error" in captured:
        return ["", f"As the batcher feeds a prompt, captured: FAILED: {captured['error']}"]
    return [
        "",
        (
            f"As the batcher feeds a prompt (the model's chunks of {captured['chunk']}, into a pool's slot): eager "
            f"{captured['eager_tokens_per_s']:.0f} tokens/s, captured {captured['captured_tokens_per_s']:.0f} "
            f"tokens/s ({captured['speedup']:.2f}×; {captured['chunk_steps']} captured chunk steps)."
        ),
    ]


def equality_lines(result: dict) -> list[str]:
    verdict = "PASS" if not result["failures"] else "FAIL"
    lines = [
        (
            f"Greedy equality, tiny model in fp32 on the device, batched against alone: {verdict} — eager "
            f"{result['eager_equal']} of {result['requests']} equal ({result['eager_near_ties']} at a near-tie), "
            f"captured {result['graphs_equal']} of {result['requests']} ({result['graphs_near_ties']} at a near-tie; "
            f"{result.get('captured_steps', 0)} captured steps); captured equals eager on "
            f"{result['graphs_equal_eager']}."
        ),
        "",
        f"bf16 row drift on the device (a logit's largest move between a one-row decode and verify blocks of 2-11 "
        f"rows, alone and pooled, relative to its row's largest): {result['bf16_drift']:.3g}"
        + (" (row-exact kernels)" if result["bf16_row_exact"] else f"; bound {result['bf16_drift_bound']:g}."),
    ]
    return lines + [f"- {failure}" for failure in result["failures"]]


def sampling_lines(result: dict) -> list[str]:
    verdict = "PASS" if not result["failures"] else "FAIL"
    lines = [
        (
            f"Speculative sampling on the device (captured steps, drafts skipping items, temperature 1, top-k 4): "
            f"{verdict} — {result['samples']} samples of (t1, t2, t3) over {result['cells']} sequences, χ² "
            f"{result['chi_square']:.1f} on {result['dof']} degrees of freedom, p = {result['p_value']:.3f}; "
            f"{result['acceptance']:.0%} of drafted tokens accepted."
        )
    ]
    return lines + [f"- {failure}" for failure in result["failures"]]


def target_lines(results: dict) -> list[str]:
    """The targets, judged at TARGET_CONTEXT from what was measured."""
    lines = []
    costs = results.get("steps")
    if isinstance(costs, list):
        for row in costs:
            if row["context"] != TARGET_CONTEXT or "graphs_ms" not in row:
                continue
            target = FLOOR_TARGETS.get(row["batch"])
            if target is not None:
                got = row["graphs_floor_over_step"]
                lines.append(f"- batch {row['batch']}: the captured step at {got:.2f} of the floor (target ≥ {target}): "
                             f"{'met' if got >= target else 'not met'}")  # fmt: skip
            if "draft_over_ar" not in row:
                continue
            misses = [k for k, r in row["draft_over_ar"].items() if r > 1 - row["draft_bytes_skipped"][k] + DRAFT_SLACK]
            lines.append(f"- batch {row['batch']}: drafts within (1 − s) + {DRAFT_SLACK}: "
                         f"{len(row['draft_over_ar']) - len(misses)} of {len(row['draft_over_ar'])}")  # fmt: skip
    plans = results.get("knapspec")
    if isinstance(plans, list):
        for plan in plans:
            if plan["batch"] == 1 and plan["context"] == TARGET_CONTEXT:
                lines.append(f"- batch 1: KnapSpec's predicted speed-up {plan['speedup']:.2f}× (target ≥ "
                             f"{SPEEDUP_TARGET}×): {'met' if plan['speedup'] >= SPEEDUP_TARGET else 'not met'}")  # fmt: skip
    return lines or ["(no step measured at the target context)"]


def format_report(header: dict, results: dict, only: str | None = None) -> str:
    """The whole report, or with `only` the section of that stage (and the targets after it)."""
    lines = [
        f"GPU check on {header['device']}: {header['shape']}-shaped model, random weights, {header['mode']}, one process"
        f"; captured steps with {header.get('graphs', 'auto attention')}.",
        "",
    ]
    builders = {
        "steps": ("Steps: eager and captured", lambda r: steps_lines(r, header["verify_rows"]) + variant_lines(r)),
        "knapspec": ("KnapSpec's predictions", lambda r: knapspec_lines(r, header["acceptance"])),
        "prefill": ("Prefill", prefill_lines),
        "attention": ("Attention routes", attention_lines),
        "equality": ("Greedy equality", equality_lines),
        "sampling": ("Speculative sampling", sampling_lines),
    }
    if only is not None:
        lines = []
    for stage, (title, build) in builders.items():
        if stage in results and only in (None, stage):
            lines += _section(title, results[stage], build)
    if ("steps" in results or "knapspec" in results) and only in (None, "steps", "knapspec"):
        lines += ["## Targets", "", *target_lines(results), ""]
    return "\n".join(lines).rstrip()
