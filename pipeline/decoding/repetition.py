"""Repetition control as logits processors inside the exact draft/verify loop.

Two processors, with transformers' semantics so that results compare with `generate()`:

- `repetition_penalty` p (Keskar et al. 2019; transformers' RepetitionPenaltyLogitsProcessor):
  the logit of every token already in the history is divided by p when positive and
  multiplied by p when negative.
- `no_repeat_ngram_size` n (fairseq, transformers' NoRepeatNGramLogitsProcessor): a token
  that would complete an n-gram already in the history gets -inf.

The history is the prompt and the answer so far (scope "all", as transformers does for a
decoder-only model), or the answer only (scope "answer": what a summary needs, since it
should not loop but may quote its document; for the penalty it is transformers'
`prompt_ignore_length` set to the prompt's length).

Exactness: the processed distribution is the one every strategy decodes from. A verify
forward's row i follows the history plus the draft's first i tokens, so each row is
processed with exactly that history: the rows acceptance reads are those of the draft
prefix it has accepted, and so a speculative step emits what plain decoding under the
same processors would. Drafters propose under the same processors (a banned draft token
is a wasted row): layer-skip drafts choose from processed logits, copied drafts stop
before a banned token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

REPETITION_SCOPES = ("all", "answer")


class RepetitionState:
    """One request's repetition controls over the tokens in its scope, kept as it decodes:
    the set of tokens seen (for the penalty) and, for each (n-1)-gram, the tokens that
    followed it (for the n-gram ban), both grown by `extend` in O(new tokens)."""

    def __init__(self, penalty: float, ngram_size: int, tokens: Sequence[int] = ()) -> None:
        self.penalty = penalty
        self.ngram_size = ngram_size
        self.tokens: list[int] = []
        self._seen: set[int] = set()
        self._unmarked: list[int] = []  # seen, not yet in _seen_mask
        self._seen_mask: torch.Tensor | None = None  # [V] bool, made at the first use
        self._followers: dict[tuple[int, ...], set[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens appended to the history (emitted, or the prompt at the start)."""
        n = self.ngram_size
        for token in tokens:
            self.tokens.append(token)
            if token not in self._seen:
                self._seen.add(token)
                self._unmarked.append(token)
            if n and len(self.tokens) >= n:
                key = tuple(self.tokens[len(self.tokens) - n : -1])
                self._followers.setdefault(key, set()).add(token)

    def banned(self, prefix: Sequence[int] = ()) -> set[int]:
        """The tokens the n-gram ban forbids after the history and then `prefix` (draft tokens)."""
        n = self.ngram_size
        if not n or len(self.tokens) + len(prefix) < n:
            return set()
        # The history's last n - 1 tokens, then the prefix: enough for every n-gram that ends in it.
        head = self.tokens[max(0, len(self.tokens) - (n - 1)) :]
        sequence = head + list(prefix)
        key = tuple(sequence[len(sequence) - (n - 1) :])
        banned = set(self._followers.get(key, ()))
        # n-grams that end in the prefix are not in the index yet.
        for end in range(max(len(head), n - 1), len(sequence)):
            if tuple(sequence[end - n + 1 : end]) == key:
                banned.add(sequence[end])
        return banned

    def allowed(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of a proposed continuation the n-gram ban lets through."""
        for j, token in enumerate(tokens):
            if token in self.banned(tokens[:j]):
                return j
        return len(tokens)

    def process(self, logits: torch.Tensor, draft: Sequence[int] = ()) -> torch.Tensor:
        """Processed float32 logits [R, V] of rows [R, V], row i following the history and
        `draft[:i]` (a verify forward's rows; R = 1 with no draft for a single next token)."""
        return self._process(logits, [draft[:i] for i in range(logits.shape[0])])

    def process_row(self, logits: torch.Tensor, prefix: Sequence[int] = ()) -> torch.Tensor:
        """Processed float32 logits [V] of one row [V] that follows the history and `prefix`."""
        return self._process(logits[None], [prefix])[0]

    def _process(self, logits: torch.Tensor, prefixes: list[Sequence[int]]) -> torch.Tensor:
        rows, vocab = logits.shape
        out = logits.to(torch.float32, copy=True)
        if self.penalty != 1.0:
            mask = self._mask(vocab, logits.device).expand(rows, vocab).clone()
            at = [(i, token) for i, prefix in enumerate(prefixes) for token in prefix if token < vocab]
            if at:
                r, c = zip(*at)
                mask[list(r), list(c)] = True
            # transformers' arithmetic, element for element: divide positive, multiply negative.
            penalized = torch.where(out < 0, out * self.penalty, out / self.penalty)
            out = torch.where(mask, penalized, out)
        if self.ngram_size:
            at = [(i, token) for i, prefix in enumerate(prefixes) for token in self.banned(prefix) if token < vocab]
            if at:
                r, c = zip(*at)
                out[list(r), list(c)] = float("-inf")
        return out

    def _mask(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self._seen_mask is None or self._seen_mask.numel() != vocab or self._seen_mask.device != device:
            self._seen_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            self._unmarked = list(self._seen)
        if self._unmarked:
            ids = [token for token in self._unmarked if token < vocab]
            self._seen_mask[ids] = True
            self._unmarked = []
        return self._seen_mask
