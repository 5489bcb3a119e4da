"""Hybrid drafting: prompt-lookup n-gram drafts beside KnapSpec's layer subsets.

Summaries copy phrases from their document. A copied draft costs no forward, so
each step the hybrid weighs the lookup draft at hand (its acceptance measured online)
against the current KnapSpec plan by predicted tokens per time, and drafts with
whichever wins — falling back, through KnapSpec, to plain decoding.

A copied draft it declines is still scored: the tokens the model emits next say how
much of it would have been accepted (exactly, under greedy decoding; with the same
probability, under sampling with a one-hot draft). Without that, a run of early
misses would stop it copying for the rest of a request, however good later copies got.
"""

from __future__ import annotations

from pipeline.decoding.drafters import BatchPlanning, Draft, DraftRequest, DraftSteps
from pipeline.decoding.prompt_lookup import PromptLookupDrafter
from pipeline.knapspec.drafter import KnapSpecDrafter
from pipeline.knapspec.latency import LatencyModel
from pipeline.knapspec.replanning import KnapSpecConfig, SearchHistory

# Copied tokens come in runs (a phrase is right as a whole or not), so the per-token
# geometric model of TPT misjudges them: the hybrid counts, for each draft position j,
# how often the first j + 1 copied tokens were all accepted, starting from an optimistic
# prior of 0.8^(j+1) worth LOOKUP_PRIOR_STEPS steps (with 0.5^(j+1) the hybrid cut copies
# short and ran 15-20% slower than plain lookup on two sample documents; with 0.8 it matched it).
LOOKUP_PRIOR_BASE = 0.8
LOOKUP_PRIOR_STEPS = 2.0


class KnapSpecLookupDrafter:
    def __init__(
        self,
        latency: LatencyModel,
        config: KnapSpecConfig,
        lookup: PromptLookupDrafter,
        history: SearchHistory | None = None,
        batch_planner: BatchPlanning | None = None,
    ) -> None:
        self.knapspec = KnapSpecDrafter(latency, config, history, batch_planner)
        self.lookup = lookup
        self.max_draft = max(config.max_draft, lookup.max_draft)
        self.num_lookup_drafted = self.num_lookup_accepted = 0
        self.num_lookup_steps = 0
        # [j]: lookup steps that drafted position j, and those that accepted positions 0..j.
        self._tries = [0] * self.max_draft
        self._reached = [0] * self.max_draft
        self._used_lookup = False
        self._proposed: tuple[int, list[int]] = (0, [])  # the copy last proposed: where it starts, its tokens
        # Declined copies awaiting the tokens that score them: (where they start, tokens).
        self._shadows: list[tuple[int, list[int]]] = []

    @property
    def latency(self) -> LatencyModel:
        """The table its layer plans are made from (as the timed steps corrected it): a copy's
        length is weighed against it too."""
        return self.knapspec.latency

    @property
    def batch_planner(self) -> BatchPlanning | None:
        """The batch planner of its layer drafts (batch_plan.py); copied drafts are its own."""
        return self.knapspec.batch_planner

    @property
    def layer_drafter(self) -> KnapSpecDrafter:
        """The drafter that holds the request's layer plan: its KnapSpec part."""
        return self.knapspec

    def survival(self, gamma: int) -> list[float]:
        """[j]: P(copied positions 0..j all accepted), for j < γ, from the counts and the prior."""
        return [
            (self._reached[j] + LOOKUP_PRIOR_BASE ** (j + 1) * LOOKUP_PRIOR_STEPS)
            / (self._tries[j] + LOOKUP_PRIOR_STEPS)
            for j in range(gamma)
        ]

    def expected_accepted(self, gamma: int) -> float:
        """E[copied tokens accepted] for a lookup draft of γ tokens: Σ_j P(positions 0..j accepted)."""
        return sum(self.survival(gamma))

    def count(self, num_drafted: int, num_accepted: int) -> None:
        """One copied draft of `num_drafted` tokens whose first `num_accepted` were (or would
        have been) accepted."""
        for j in range(num_drafted):
            self._tries[j] += 1
            self._reached[j] += j < num_accepted

    def score_declined(self, token_ids: list[int]) -> None:
        """Score the declined copies whose outcome the emitted tokens now decide."""
        waiting = []
        for start, tokens in self._shadows:
            emitted = token_ids[start : start + len(tokens)]
            matched = 0
            while matched < len(emitted) and emitted[matched] == tokens[matched]:
                matched += 1
            if matched < len(emitted) or len(emitted) == len(tokens):
                self.count(len(tokens), matched)
            else:
                waiting.append((start, tokens))  # right so far: the next tokens decide
        self._shadows = waiting

    def propose_steps(self, request: DraftRequest) -> DraftSteps:
        self.score_declined(request.token_ids)
        draft = self.lookup.propose(request)
        self._used_lookup = False
        if draft.token_ids:
            copied = draft.token_ids
            context = request.cache.length
            # The best prefix of the copied draft by predicted TPT: a shaky copy is cut short.
            tpt_lookup, gamma = max(
                ((1.0 + self.expected_accepted(g)) / self.latency.t_verify(g + 1, context), g)
                for g in range(1, min(len(draft.token_ids), self.latency.max_verify - 1) + 1)
            )
            draft = Draft(draft.token_ids[:gamma], None if draft.probs is None else draft.probs[:gamma])
            draft.survival = self.survival(gamma)  # a batch may verify less of it (batch_drafts.py)
            # Against the layer plan's gain over plain decoding: a batch's plan predicts the batch's
            # rate, in other units than this request's copy alone (knapspec/batch_plan.py).
            plan = self.knapspec.plan
            gain_layers = plan.predicted_tpt / plan.ar_tpt if plan is not None and plan.ar_tpt > 0 else 1.0
            if tpt_lookup >= gain_layers / self.latency.t_verify(1, context):
                self._used_lookup = True
                self._proposed = (len(request.token_ids), draft.token_ids)
                self.knapspec.count_step(context)
                return draft
            # The tokens after `pending` will tell how this copy would have done, position by position.
            self._shadows.append((len(request.token_ids), copied))
        return (yield from self.knapspec.propose_steps(request))

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if self._used_lookup:
            self.knapspec.history.step_tokens.append(num_accepted + 1)  # (the knapspec drafter notes its own)
            self.num_lookup_steps += 1
            self.num_lookup_drafted += num_drafted
            self.num_lookup_accepted += num_accepted
            start, proposed = self._proposed
            cut = num_drafted < len(proposed)  # a batch verified only part of the copy
            if cut and num_accepted == num_drafted:
                # All of that part accepted: the tokens emitted next tell how the rest would
                # have done, as for a declined copy.
                self._shadows.append((start, proposed))
            else:
                # A miss ends the copy: positions past it were not reached, verified or cut.
                self.count(len(proposed) if cut else num_drafted, num_accepted)
            self.lookup.observe(num_drafted, num_accepted)
        else:
            self.knapspec.observe(num_drafted, num_accepted)

    def summary(self) -> dict:
        return self.knapspec.summary() | {
            "num_lookup_steps": self.num_lookup_steps,
            "lookup_acceptance": self.num_lookup_accepted / self.num_lookup_drafted if self.num_lookup_drafted else 0.0,
        }
