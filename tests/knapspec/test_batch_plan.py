"""KnapSpec for batches: the batched step's latency model and item weights, the DP over
reference tokens pooled from several requests, the batch's plan, and exactness: every
request of a batch planned together keeps the tokens it decodes alone with `ar`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.decoding.batch_drafts import DraftBudget
from pipeline.decoding.decode import decode, decode_requests
from pipeline.decoding.loop import DecodeConfig, DecodingRequest, prefill
from pipeline.decoding.prompt_lookup import PromptLookupDrafter
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.scheduler import ContinuousBatcher, GenerationRequest
from pipeline.decoding.step_cost import OnlineStepCost, StepCost
from pipeline.knapspec import batch_plan
from pipeline.knapspec.batch_latency import BatchLatency, BatchShape
from pipeline.knapspec.batch_plan import (
    BatchCandidate,
    BatchPlanner,
    ReferenceSpan,
    choose_batch_plan,
    pooled_runner,
    search_batch_candidates,
)
from pipeline.knapspec.drafter import KnapSpecDrafter
from pipeline.knapspec.hybrid import KnapSpecLookupDrafter
from pipeline.knapspec.knapsack import KnapsackProblem, run_dp
from pipeline.knapspec.latency import LatencyModel
from pipeline.model import items
from tests.builders import (
    SEARCH_CONFIG,
    assert_same_or_near_tie,
    brute_force,
    load_tiny,
    random_knapsack,
    repeating_prompt,
)
from tests.slow_device import slow_down

MS = 1e-3
EOS = frozenset({2})


def cpu_like_table(num_layers: int = 30) -> LatencyModel:
    """Shaped like SmolLM2 fp16w on two CPU cores: the linears ~23 ms a token, attention ~0.12 ms
    per item per 1k cached tokens, a verify of 11 tokens ~2× one."""
    return LatencyModel(
        attn_slope=0.12e-6,
        attn_base=0.25 * MS,
        t_mlp=0.45 * MS,
        t_fixed=2.0 * MS,
        verify_ratios=tuple(1.0 + 0.1 * k for k in range(11)),
        num_layers=num_layers,
    )


# ------------------------------------------------------------ latency model


def test_a_full_step_costs_what_the_step_model_says_and_skips_save_their_items():
    latency = BatchLatency.of(cpu_like_table())
    shape = BatchShape((1000, 3000, 500), (1, 4, 2), padded=False)
    assert latency.t_step((), shape) == pytest.approx(latency.cost.seconds(shape.contexts, shape.rows))
    costs = latency.item_costs(shape)
    skip = {items.attention_item(3), items.attention_item(7), items.mlp_item(5)}
    assert latency.t_step(skip, shape) == pytest.approx(latency.t_step((), shape) - 2 * costs.attention - costs.mlp)
    every = set(range(latency.num_items))
    assert latency.t_step(every, shape) == pytest.approx(costs.rest)
    # At batch 1 the parts are the table's own: an MLP item is t_mlp, an attention item a·n + b.
    table = cpu_like_table()
    alone = BatchLatency.of(table).item_costs(BatchShape.decoding([2000]))
    assert alone.mlp == pytest.approx(table.t_mlp)
    assert alone.attention == pytest.approx(table.t_attn(2000))


def test_weights_move_toward_attention_as_batch_times_context_grows():
    latency = BatchLatency.of(cpu_like_table())
    ratios = {}
    for batch in (1, 4, 8, 16, 32):
        for context in (512, 1024, 4096, 7000):
            costs = latency.item_costs(BatchShape.decoding([context] * batch, padded=True))
            ratios[batch, context] = costs.attention / costs.mlp
    for batch in (1, 4, 8, 16, 32):
        row = [ratios[batch, n] for n in (512, 1024, 4096, 7000)]
        assert row == sorted(row), f"at batch {batch} attention must weigh more with context"
    for context in (512, 1024, 4096, 7000):
        column = [ratios[b, context] for b in (1, 4, 8, 16, 32)]
        assert column == sorted(column), f"at {context} attention must weigh more with the batch"
    small = latency.item_weights(BatchShape.decoding([512]))
    large = latency.item_weights(BatchShape.decoding([7000] * 16, padded=True))
    assert small[items.mlp_item(1)] >= small[items.attention_item(1)]  # MLP dearer alone at short context
    assert large[items.attention_item(1)] > large[items.mlp_item(1)] == 1  # attention dearer in a large batch
    # Attention's share of the step: what skipping it can save.
    assert latency.attention_fraction(BatchShape.decoding([7000] * 16)) > 0.7
    assert latency.attention_fraction(BatchShape.decoding([512])) < 0.4


def test_a_pooled_step_pays_the_widest_block_for_every_slot():
    latency = BatchLatency.of(cpu_like_table())
    own = BatchShape((4000, 4000), (1, 5), padded=False)
    padded = BatchShape((4000, 4000), (1, 5), padded=True)
    assert latency.t_step((), padded) > latency.t_step((), own)
    with pytest.raises(ValueError):
        BatchShape((100,), (0,))
    with pytest.raises(ValueError):
        latency.t_step({latency.num_items}, own)


def test_batch_tpt_prefers_ar_when_verify_rows_are_dear_and_drafts_when_they_are_cheap():
    # The same candidate: half the attention skipped, every request accepting 0.9.
    skip = frozenset(items.attention_item(i) for i in range(1, 15))
    candidate = BatchCandidate(skip, (0.9,) * 8)
    contexts = [4096] * 8
    dear = BatchLatency(StepCost(fixed=10 * MS, per_row=2.5 * MS, per_key=3e-6, per_key_row=3e-6), 0.004, 0.01, 30)
    cheap = dataclasses.replace(dear, cost=StepCost(fixed=10 * MS, per_row=0.05 * MS, per_key=3e-6, per_key_row=0.0))
    choice = choose_batch_plan([candidate], dear, contexts, True, 6, 0.05)
    assert choice.plan.use_ar and choice.tpt == choice.ar_tpt
    # The best drafting plan is still reported, with what it would have made: the AR verdict's reason.
    assert choice.best_draft.skip == skip and choice.best_draft_tpt < 1.05 * choice.ar_tpt
    choice = choose_batch_plan([candidate], cheap, contexts, True, 6, 0.05)
    assert not choice.plan.use_ar and choice.plan.skip == skip and choice.tpt > 1.05 * choice.ar_tpt
    assert choice.plan.predicted_tpt == pytest.approx(choice.tpt / 8)  # per request, as a single request's plan


# ------------------------------------------------------------ pooled DP


class SpanModel:
    """Items that add along their own axis, as tests/knapspec/test_knapsack.py's; an attention
    item reads the span's cache (a number here) and records which span and start it ran on."""

    def __init__(self, magnitudes):
        self.magnitudes = magnitudes
        self.calls: list[tuple[int, object, int, int]] = []

    def run_item_branches(self, item, hidden, cache, start):
        self.calls.append((item, cache, start, hidden.shape[1]))
        step = torch.zeros(hidden.shape[-1])
        step[item + 1] = self.magnitudes[item]
        return hidden + step


@pytest.mark.parametrize("seed", range(4))
def test_the_pooled_dp_equals_brute_force_where_the_objective_decomposes(seed):
    num_items = 8
    magnitudes, weights = random_knapsack(seed, num_items)
    model = SpanModel(magnitudes)
    spans = [ReferenceSpan("cache-a", torch.zeros(2), 10), ReferenceSpan("cache-b", torch.zeros(3), 40)]
    start = torch.zeros(5, num_items + 1)
    start[:, 0] = 1.0
    problem = KnapsackProblem(weights=weights, budget=sum(weights) // 2, threshold=-1.0)
    frontier = run_dp(start, problem, pooled_runner(model, spans))
    values = [m * m for m in magnitudes]
    expected = brute_force(values, weights, problem.budget)
    got = {c.skipped_weight: sum(values) - sum(values[i] for i in c.skip) for c in frontier.candidates()}
    assert set(got) == set(expected)
    for weight, kept in expected.items():
        assert got[weight] == pytest.approx(kept, rel=1e-5)
    # Attention items run span by span over each span's own cache; MLP items once over all tokens.
    for item in range(num_items):
        ran = [(cache, at, n) for i, cache, at, n in model.calls if i == item]
        if items.is_attention(item):
            assert ran == [("cache-a", 10, 2), ("cache-b", 40, 3)]
        else:
            assert [n for _, _, n in ran] == [5]


def test_the_pooled_full_model_is_each_requests_own_forward(tiny_checkpoint):
    _, model = load_tiny(tiny_checkpoint)
    spans, expected = [], []
    for seed, (length, r) in enumerate([(40, 4), (70, 6), (25, 3)]):
        tokens = torch.randint(3, 96, (length,), generator=torch.Generator().manual_seed(seed))
        cache = model.new_cache(length + 4)
        model.prefill(cache, tokens)
        own = model.forward(cache.copy(), tokens[length - r :], length - r, logits="none", return_hidden=True)
        expected.append(own.hidden_states[-1])
        spans.append(ReferenceSpan(cache, tokens[length - r :], length - r))
    problem = KnapsackProblem(weights=(1,) * model.spec.num_items, budget=0, threshold=-1.0)
    tokens = torch.cat([s.ids for s in spans])
    frontier = run_dp(model.embed_tokens(tokens), problem, pooled_runner(model, spans))
    torch.testing.assert_close(frontier.hidden[0], torch.cat(expected), atol=1e-4, rtol=0)
    candidates = search_batch_candidates(model, spans, dataclasses.replace(problem, budget=4))
    assert candidates[0][0] == frozenset()
    assert [t.numel() for t in candidates[0][1]] == [4, 6, 3]


# ------------------------------------------------------------ planning a batch


def batch_table(num_layers: int) -> LatencyModel:
    """A device where a batch's verify rows are nearly free and attention is dear: the batch
    planner drafts (so that exactness is tested on plans that skip)."""
    return LatencyModel(
        attn_slope=2e-6,
        attn_base=4e-3,
        t_mlp=0.5e-3,
        t_fixed=0.2e-3,
        verify_ratios=(1.0,) * 11,
        num_layers=num_layers,
    )


def planned_batch(model, latency, hybrid: bool = False, **overrides):
    config = dataclasses.replace(SEARCH_CONFIG, **({"max_search_share": None} | overrides))
    planner = BatchPlanner(latency, config)

    def drafter():
        if hybrid:
            return KnapSpecLookupDrafter(latency, config, PromptLookupDrafter(), batch_planner=planner)
        return KnapSpecDrafter(latency, config, batch_planner=planner)

    return planner, drafter


def alone(model, prompt: torch.Tensor, limit: int) -> list[int]:
    return decode(model, prefill(model, prompt, limit), DecodeConfig(limit, EOS), SamplingParams()).token_ids


def decode_planned(checkpoint, hybrid: bool):
    """Four requests of mixed lengths and limits decoded together under one batch planner;
    each request's tokens against its own `ar` alone."""
    _, model = load_tiny(checkpoint)
    planner, drafter = planned_batch(model, batch_table(model.spec.num_layers), hybrid)
    prompts = [repeating_prompt(n, seed) for seed, n in enumerate((30, 55, 12, 41))]
    limits = [24, 16, 30, 20]
    requests = []
    for prompt, limit in zip(prompts, limits):
        prefilled = prefill(model, prompt, limit)
        config = DecodeConfig(limit, EOS)
        requests.append(DecodingRequest(prefilled, config, SamplingParams(), drafter(), prompt.tolist()))
    results = decode_requests(model, requests)
    for prompt, limit, result in zip(prompts, limits, results):
        assert_same_or_near_tie(model, prompt, result.token_ids, alone(model, prompt, limit))
    assert any(s["searched"] for s in planner.searches), "the batch planner searched"
    # Each result carries the searches it took part in: together, every search the planner made.
    carried = {s["id"]: s for r in results for s in r.extra["batch_searches"]}
    assert [carried[i] for i in sorted(carried)] == list(planner.searches)
    assert results[0].extra["num_batch_searches_postponed"] == planner.num_postponed
    return planner, requests, results


@pytest.mark.parametrize("hybrid", [False, True], ids=["knapspec", "knapspec-lookup"])
def test_a_batch_planned_together_keeps_every_requests_tokens(tiny_checkpoint, hybrid):
    decode_planned(tiny_checkpoint, hybrid)


@pytest.mark.parametrize("hybrid", [False, True], ids=["knapspec", "knapspec-lookup"])
def test_batch_plans_that_skip_keep_every_requests_tokens(tiny_deep_llama, hybrid):
    """On a model whose middle layers are nearly redundant the batch's plans draft."""
    planner, requests, results = decode_planned(tiny_deep_llama, hybrid)
    drafting = [s for s in planner.searches if s["skipped_attn"] + s["skipped_mlp"]]
    assert drafting, "a batch plan that skips, so that exactness is tested on it"
    layer_drafted = sum(r.stats.drafted_tokens for r in results) - sum(
        getattr(r.drafter, "num_lookup_drafted", 0) for r in requests
    )
    assert layer_drafted > 0


def counting_batch_searches(monkeypatch) -> list[int]:
    calls = []
    real = batch_plan.search_batch_candidates
    monkeypatch.setattr(batch_plan, "search_batch_candidates", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def steps_cost_what_the_table_says(monkeypatch) -> None:
    """The batch's step-cost fit stays at its table: a search budget is then the table's, not
    the tiny model's (a few ms a step, where no search pays; the fit is tested on its own)."""
    monkeypatch.setattr(OnlineStepCost, "current", lambda self: self.prior)


def decode_two_planned(model, owing: float = 0.0, **overrides) -> BatchPlanner:
    """Two requests of 40 tokens under a fresh batch planner that owes `owing` search seconds,
    each against its own `ar` alone."""
    prompts = [repeating_prompt(n, seed) for seed, n in enumerate((30, 41))]
    planner, drafter = planned_batch(model, batch_table(model.spec.num_layers), reoptimize_every=40, **overrides)
    planner.history.searched(owing, share=0.5)
    requests = [
        DecodingRequest(prefill(model, p, 40), DecodeConfig(40), SamplingParams(), drafter(), p.tolist())
        for p in prompts
    ]
    for prompt, result in zip(prompts, decode_requests(model, requests)):
        expected = decode(model, prefill(model, prompt, 40), DecodeConfig(40), SamplingParams()).token_ids
        assert_same_or_near_tie(model, prompt, result.token_ids, expected)
    return planner


def test_a_batch_search_that_cannot_pay_for_itself_is_postponed(tiny_deep_llama, monkeypatch):
    """Where the search would cost more than its share of what a perfect draft could save, the
    batch decodes plainly until the next check: no DP runs and every request keeps its tokens.
    The same batch with room for its search searches."""
    steps_cost_what_the_table_says(monkeypatch)
    calls = counting_batch_searches(monkeypatch)
    _, model = load_tiny(tiny_deep_llama)
    stingy = decode_two_planned(model, max_search_share_of_gain=1e-4)
    assert calls == [] and stingy.num_postponed >= 1
    assert not any(s["searched"] for s in stingy.searches)
    generous = decode_two_planned(model, max_search_share_of_gain=1.0)
    assert calls and any(s["searched"] for s in generous.searches)


def test_a_batch_search_plans_for_the_steps_at_its_tokens_per_step(tiny_deep_llama, monkeypatch):
    """A batch whose requests accept drafts decodes its tokens in fewer steps: its search budget
    counts those steps, not one per token (with copied drafts a search took 5.5% of a decode
    budgeted at 5%)."""
    seen = []
    real = batch_plan.steps_planned_for
    monkeypatch.setattr(batch_plan, "steps_planned_for", lambda *a: seen.append(a) or real(*a))
    _, model = load_tiny(tiny_deep_llama)
    planner, drafter = planned_batch(model, batch_table(model.spec.num_layers), max_search_share=0.05)
    planner.history.step_tokens.extend([2] * 8)  # earlier requests: two tokens a step
    prompts = [repeating_prompt(n, seed) for seed, n in enumerate((30, 41))]
    requests = [
        DecodingRequest(prefill(model, p, 40), DecodeConfig(40), SamplingParams(), drafter(), p.tolist())
        for p in prompts
    ]
    decode_requests(model, requests)
    assert seen, "a batch search was budgeted"
    interval, tokens_left, tokens_per_step = seen[0]
    assert tokens_left <= 40 and tokens_per_step == pytest.approx(planner.history.tokens_per_step(), rel=0.5)
    assert tokens_per_step > 1.0


def test_a_batch_search_waits_until_decoding_has_paid_for_the_last(tiny_deep_llama, monkeypatch):
    """Searches share one budget: while the engine's search debt exceeds what a new search may
    take, the batch decodes plainly (and exactly), each batch step paying back its share."""
    steps_cost_what_the_table_says(monkeypatch)
    calls = counting_batch_searches(monkeypatch)
    _, model = load_tiny(tiny_deep_llama)
    owing = decode_two_planned(model, owing=1e3, max_search_share_of_gain=1.0)
    assert calls == [] and owing.num_postponed >= 1
    assert 0 < 1e3 - owing.history.search_debt < 1.0  # 40 steps of a few ms, half of them paid back
    decode_two_planned(model, owing=0.0, max_search_share_of_gain=1.0)
    assert calls  # the same batch, owing nothing, searches


def test_requests_join_the_batch_plan_and_plan_alone_when_left_alone(tiny_deep_llama):
    """In a continuous batch a joining request adopts the current plan without a new search;
    the last request left plans for itself; tokens stay those of `ar` alone."""
    _, model = load_tiny(tiny_deep_llama)
    planner, drafter = planned_batch(model, batch_table(model.spec.num_layers))
    prompts = [repeating_prompt(n, seed) for seed, n in enumerate((10, 40, 30))]
    limits = [48, 30, 12]
    batcher = ContinuousBatcher(model, max_batch=3, prefill_chunk=32)
    drafters = [drafter() for _ in prompts]

    def submit(k: int) -> int:
        return batcher.submit(GenerationRequest(prompts[k], DecodeConfig(limits[k]), SamplingParams(), drafters[k]))

    tickets = [submit(0), submit(1)]
    finished = []
    while not planner.searches:  # the first two are planned together ...
        finished += batcher.step()
    tickets.append(submit(2))  # ... then the third joins
    while len(batcher.running) < 3:
        finished += batcher.step()
    searches, weights = len(planner.searches), planner._weights
    finished += batcher.step()
    assert all(d._adopted and d.plan is drafters[0].plan for d in drafters), "one plan for the batch"
    if planner._weights == weights:  # (timed steps set the weights: a new batch shape may change them)
        assert len(planner.searches) == searches, "the joining request adopted the plan without a search"
    finished += batcher.run()
    done = {f.ticket: f for f in finished}
    for ticket, prompt, limit in zip(tickets, prompts, limits):
        assert done[ticket].error is None
        expected = decode(model, prefill(model, prompt, limit), DecodeConfig(limit), SamplingParams()).token_ids
        assert_same_or_near_tie(model, prompt, done[ticket].result.token_ids, expected)
    # The longest request outlived the others: it was released to plan alone.
    assert not drafters[0]._adopted
    assert len(planner.searches) < batcher.steps


def test_a_request_alone_plans_from_its_timed_steps_at_its_own_checks(tiny_deep_llama):
    """A request decoding alone under a table measured on a device 20-30 times faster (the test
    throttle slows every MLP call): from its first check after a few timed steps it plans from
    the table as the steps corrected it, predicting its step within 15%, and it searches no more
    often than its schedule says (the table changes only when a check is due anyway)."""
    _, model = load_tiny(tiny_deep_llama)
    fast = LatencyModel(
        attn_slope=0.1e-6,
        attn_base=0.1 * MS,
        t_mlp=0.1 * MS,
        t_fixed=0.1 * MS,
        verify_ratios=tuple(1.0 + 0.05 * k for k in range(11)),
        num_layers=model.spec.num_layers,
    )
    _, drafter = planned_batch(model, fast, reoptimize_every=16)
    slow_down(model, 5 * MS, sublayers=("mlp",))
    prompt, limit = repeating_prompt(30, 0), 48
    request = drafter()
    budget = DraftBudget()
    prefilled = prefill(model, prompt, limit)
    result = decode(model, prefilled, DecodeConfig(limit), SamplingParams(), request, prompt.tolist(), budget)
    expected = decode(model, prefill(model, prompt, limit), DecodeConfig(limit), SamplingParams()).token_ids
    assert_same_or_near_tie(model, prompt, result.token_ids, expected)
    assert request.table is fast and request.latency is not fast
    context = prompt.numel() + limit
    fitted = budget.cost.current().seconds([context], [1])
    assert request.latency.t_verify(1, context) == pytest.approx(fitted, rel=0.1)  # (the fit at its last check)
    _, fit_error = budget.cost.prediction_errors(after=16)
    assert fit_error < 0.15 and fast.t_verify(1, context) < 0.2 * fitted
    checks = len(request.plans) + request.num_postponed
    assert checks <= 1 + result.stats.steps // 16, (checks, result.stats.steps)


def dear_verify_batch(model, count: int):
    """A planner whose table makes every verify row cost a whole forward, and `count` prefilled
    requests drafting with it."""
    dear = dataclasses.replace(batch_table(model.spec.num_layers), verify_ratios=tuple(1.0 + k for k in range(11)))
    planner, drafter = planned_batch(model, dear)
    requests = []
    for seed in range(count):
        prompt = repeating_prompt(30, seed)
        requests.append(
            DecodingRequest(prefill(model, prompt, 12), DecodeConfig(12), SamplingParams(), drafter(), prompt.tolist())
        )
    return planner, requests


def test_the_batch_search_is_skipped_when_not_even_a_perfect_draft_would_pay(tiny_llama):
    _, model = load_tiny(tiny_llama)
    planner, requests = dear_verify_batch(model, 3)
    planner.prepare(model, requests, None)
    assert planner.plan.use_ar and len(planner.searches) == planner.num_searches == 1
    assert not planner.searches[0]["searched"]
    assert all(r.drafter._adopted and r.drafter.plan is planner.plan for r in requests)
    planner.prepare(model, requests[:1], None)  # alone: the request plans for itself
    assert not requests[0].drafter._adopted


def test_a_planner_keeps_the_record_of_its_last_searches_only(tiny_llama, monkeypatch):
    """A replica's planner lives as long as its job: its record of searches is bounded, its count not."""
    monkeypatch.setattr(batch_plan, "SEARCHES_KEPT", 2)
    _, model = load_tiny(tiny_llama)
    planner, requests = dear_verify_batch(model, 2)
    for _ in range(5):
        planner.plan = None  # due for a new plan
        planner.prepare(model, requests, None)
    assert planner.num_searches == 5 and len(planner.searches) == 2
