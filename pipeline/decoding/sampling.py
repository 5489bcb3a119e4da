"""Token choice: greedy, sampling, and the acceptance rules of speculative decoding.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): a drafted token x
drawn from the draft distribution q is kept with probability min(1, p(x) / q(x));
at the first rejection the token is redrawn from normalize(max(p - q, 0)); if every
draft is kept, one bonus token is drawn from p. The emitted sequence is then
distributed exactly as sampling from p token by token. `p` and `q` here are the
processed distributions (repetition control, temperature, top-k, top-p), so "exactly the model's" means
exactly what plain sampling with the same settings would give.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeline.decoding.repetition import REPETITION_SCOPES, RepetitionState
from pipeline.errors import ConfigError, NonFiniteLogits


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 switch those filters off.
    repetition_penalty 1.0 and no_repeat_ngram_size 0 switch repetition control off; its scope
    is the prompt and the answer ("all", as transformers) or the answer only (repetition.py)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    repetition_scope: str = "all"
    # End the answer at its first sentence end once it is this many tokens long, and cut an
    # unfinished last sentence from an answer that used its whole budget (stopping.py). None: off.
    end_on_sentence_after: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if not self.repetition_penalty > 0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.no_repeat_ngram_size < 0:
            raise ConfigError(f"no_repeat_ngram_size must be >= 0, got {self.no_repeat_ngram_size}")
        if self.end_on_sentence_after is not None and self.end_on_sentence_after < 1:
            raise ConfigError(f"end_on_sentence_after must be >= 1 or None, got {self.end_on_sentence_after}")
        if self.repetition_scope not in REPETITION_SCOPES:
            raise ConfigError(
                f"repetition_scope must be one of {', '.join(REPETITION_SCOPES)}, got {self.repetition_scope!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def controls_repetition(self) -> bool:
        return self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0

    def repetition(self, prompt_ids: Sequence[int]) -> RepetitionState | None:
        """A request's repetition state after its prompt; None when repetition control is off."""
        if not self.controls_repetition:
            return None
        history = prompt_ids if self.repetition_scope == "all" else ()
        return RepetitionState(self.repetition_penalty, self.no_repeat_ngram_size, history)

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """The request's random stream, on the device its logits are on (a CUDA sample draws from a
        CUDA generator; a seed gives each device its own stream)."""
        if self.greedy:
            return None
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution [..., V] for logits [..., V] (float32)."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= params.top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.softmax(logits, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


def accept_greedy(draft_ids: list[int], target_logits: torch.Tensor) -> list[int]:
    """Tokens emitted by one greedy verification: the longest prefix of the draft that
    equals the target's argmax, then the target's own next token.

    target_logits: [len(draft_ids) + 1, V], row i predicting the token after draft i - 1.
    """
    return greedy_emitted(draft_ids, greedy_decision(target_logits).tolist())


def greedy_decision(target_logits: torch.Tensor) -> torch.Tensor:
    """What a greedy verification needs of its logits [n + 1, V], on their device: each row's
    argmax, then whether it is not finite (a NaN row's argmax is garbage) -> [2 (n + 1)].

    One `max` gives both: its indices are argmax's (the first of equal values; a NaN's, since
    it propagates NaN), and its values are finite exactly where non_finite says so. On CPU it
    is a third of argmax's time over a vocabulary of 49k (25 against 71 µs, 2 cores), and a
    batch step takes it once per request."""
    top, index = target_logits.max(dim=-1)
    return torch.cat([index, (~torch.isfinite(top)).long()])


def greedy_emitted(draft_ids: Sequence[int], decision: Sequence[int]) -> list[int]:
    """The tokens a greedy verification emits, from its decision (greedy_decision) on the host."""
    rows = len(decision) // 2
    raise_if_non_finite(decision[rows:])
    emitted = []
    for draft, target in zip(draft_ids, decision):
        if draft != target:
            break
        emitted.append(draft)
    emitted.append(decision[len(emitted)])
    return emitted


def check_finite(logits: torch.Tensor) -> None:
    """Raise NonFiniteLogits if a row of `logits` [..., V] holds NaN or an infinity."""
    raise_if_non_finite(non_finite(logits.reshape(-1, logits.shape[-1])).tolist())


def non_finite(logits: torch.Tensor) -> torch.Tensor:
    """[rows] of 0/1 (int64): 1 where a row's largest logit is not finite, which NaN anywhere
    in the row makes it (amax propagates NaN), as does +inf, or a row that is all -inf."""
    return (~torch.isfinite(logits.amax(dim=-1))).long()


def raise_if_non_finite(flags: list[int]) -> None:
    if any(flags):
        raise NonFiniteLogits(
            f"the model's logits are NaN or infinite (row {flags.index(1)} of {len(flags)} of a forward): "
            "its numbers overflowed on this input; a wider dtype (--dtype fp32 or bf16) may hold them"
        )


def sampled_decision(
    draft_ids: Sequence[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Speculative sampling's every draw at once, on the target's device -> [2n + 1]: whether
    each draft token is kept (u < p / q), the token each position would emit if it were the
    first rejected one (drawn from normalize(max(p - q, 0))), and the bonus token (from p after
    the last draft). The draws are independent of one another, so taking the first rejection's
    token afterwards (sampled_emitted) gives exactly the law of drawing them one at a time."""
    n = len(draft_ids)
    device = target_probs.device
    rows = target_probs
    kept = torch.empty(0, dtype=torch.long, device=device)
    if n:
        tokens = torch.tensor(draft_ids, device=device)[:, None]
        draft_probs = draft_probs.to(device)
        p = target_probs[:n].gather(1, tokens)[:, 0]
        q = draft_probs.gather(1, tokens)[:, 0]
        u = torch.rand(n, generator=generator, device=device)
        kept = (u * q < p).long()  # u < p / q without dividing by a tiny q
        residual = (target_probs[:n] - draft_probs).clamp_min(0)  # multinomial normalizes it
        # p == q up to rounding leaves no residual mass; p itself is then the right law.
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, target_probs[:n])
        rows = torch.cat([residual, target_probs[n:]])
    # A row of non-finite logits is refused from the host (greedy_emitted's flags); until then it
    # draws from anything finite, since multinomial would fail on the device, unexplained.
    usable = torch.isfinite(rows).all(dim=-1, keepdim=True) & (rows.sum(dim=-1, keepdim=True) > 0)
    rows = torch.where(usable, rows, torch.ones_like(rows))
    return torch.cat([kept, torch.multinomial(rows, 1, generator=generator)[:, 0]])


def sampled_emitted(draft_ids: Sequence[int], decision: Sequence[int]) -> list[int]:
    """The tokens a speculative-sampling verification emits, from its decision on the host:
    the draft up to its first rejected token, then that position's token (or the bonus)."""
    n = len(draft_ids)
    kept, drawn = decision[:n], decision[n:]
    emitted = []
    for i, token in enumerate(draft_ids):
        if not kept[i]:
            return emitted + [drawn[i]]
        emitted.append(token)
    return emitted + [drawn[n]]
