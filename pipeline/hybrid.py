"""Hybrid drafting: prompt-lookup n-gram drafts beside KnapSpec's layer subsets.

Summaries copy phrases from their document. A copied draft costs no forward, so
each step the hybrid weighs the lookup draft at hand (its acceptance measured online)
against the current KnapSpec plan by predicted tokens per time, and drafts with
whichever wins — falling back, through KnapSpec, to plain decoding.
"""

from __future__ import annotations

from pipeline.drafters import Draft, DraftRequest
from pipeline.knapspec import KnapSpecConfig, KnapSpecDrafter
from pipeline.latency_model import LatencyModel
from pipeline.prompt_lookup import PromptLookupDrafter
from pipeline.tpt import expected_tokens, smoothed_alpha

# Prior on a copied token being right, worth this many observed tokens.
LOOKUP_PRIOR_MEAN = 0.5
LOOKUP_PRIOR_STRENGTH = 4.0


class KnapSpecLookupDrafter:
    def __init__(self, latency: LatencyModel, config: KnapSpecConfig, lookup: PromptLookupDrafter) -> None:
        self.latency = latency
        self.knapspec = KnapSpecDrafter(latency, config)
        self.lookup = lookup
        self.max_draft = max(config.max_draft, lookup.max_draft)
        self.num_lookup_drafted = self.num_lookup_accepted = 0
        self.num_lookup_steps = 0
        self._used_lookup = False

    @property
    def lookup_alpha(self) -> float:
        return smoothed_alpha(
            0, 0, self.num_lookup_accepted, self.num_lookup_drafted, LOOKUP_PRIOR_MEAN, LOOKUP_PRIOR_STRENGTH
        )

    def propose(self, request: DraftRequest) -> Draft:
        draft = self.lookup.propose(request)
        self._used_lookup = False
        if draft.token_ids:
            context = request.cache.length
            gamma = min(len(draft.token_ids), self.latency.max_verify - 1)
            draft = Draft(draft.token_ids[:gamma], None if draft.probs is None else draft.probs[:gamma])
            tpt_lookup = expected_tokens(self.lookup_alpha, gamma) / self.latency.t_verify(gamma + 1, context)
            plan = self.knapspec.plan
            tpt_layers = plan.predicted_tpt if plan is not None else 1.0 / self.latency.t_verify(1, context)
            if tpt_lookup >= tpt_layers:
                self._used_lookup = True
                return draft
        return self.knapspec.propose(request)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if self._used_lookup:
            self.num_lookup_steps += 1
            self.num_lookup_drafted += num_drafted
            self.num_lookup_accepted += num_accepted
            self.lookup.observe(num_drafted, num_accepted)
        else:
            self.knapspec.observe(num_drafted, num_accepted)

    def summary(self) -> dict:
        return self.knapspec.summary() | {
            "num_lookup_steps": self.num_lookup_steps,
            "lookup_acceptance": self.num_lookup_accepted / self.num_lookup_drafted if self.num_lookup_drafted else 0.0,
        }
