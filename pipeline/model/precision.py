"""What a compute mode promises about a request's greedy tokens: alone, speculative and batched.

A plain decode runs one row of a request through the model; a verify runs 1 + γ rows; a batch
packs many requests' rows into each call. Whether a row's result depends on the rows beside
it is a property of the kernels the mode runs, and it decides what exactness can mean:

- **Row-exact.** Every operation gives a row the bits it gets alone: the kernel build's linears
  and attention (`csrc/`: one FMA chain per output, over k in order; a key's score and a row's
  softmax never depend on another row), and row-local norms and element-wise operations. A
  request's greedy tokens are then the same alone, speculative and in any batch, token for
  token, on every CPU, for drafts of up to 31 tokens (a verify within the kernels' 32 rows;
  `StrategyConfig` refuses longer ones). The `fp16w`, `fp16w-bf16` and `bf16` modes on x86 CPUs
  with the kernel build, for head sizes it was built for (16, 32, 64, 128). A prompt's chunks
  (oneDNN's bf16 products in fp16w-bf16) are the request's own: their rows depend on its
  prompt alone, and every strategy prefills alike.
- **Equal up to a near-tie.** PyTorch's linears and matmuls (MKL, oneDNN, cuBLAS) choose their
  kernels and blocking by the number of rows and by the CPU's instruction set, so a row's
  logits move in their last bits as its neighbours change; in bf16 by several units of its
  last place (measured on a 2-core Xeon, oneDNN forced to AVX-512 without bf16 instructions:
  from 4 rows on, a verify rounded its rows differently from their decode). A greedy token can
  then differ from plain decoding only where plain decoding's two best logits were closer than
  the two logits can move apart: `tie_gap`. The `fp32` mode everywhere (transformers' own
  math, as its reference), and `bf16` on a GPU or without the kernel build.

`MAX_DRIFT` is the most a logit was seen to move, relative to the largest |logit| of its row,
between a one-row decode and the same positions in verify blocks of 2-11 rows, alone and
pooled beside another request (`row_drift`), on SmolLM2-135M-Instruct over two sample
documents, under every instruction set oneDNN and MKL could be forced to on an AMX Xeon
(AVX2, AVX-512, AVX-512 with bf16, AMX). `tests/model/test_precision.py` measures it again on
every run: zero where the mode is row-exact, within the bound where it is not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeline.model.linear import ComputeMode
from pipeline.model.packing import RequestRows

# Measured drift (see the module's doc), about twice the most seen, for other models and CPUs:
# fp32 moved up to 2.1e-6 of the row's largest |logit| (~5e-5 at logits near 22); fp16w without
# the kernel build (FBGEMM's linears, PyTorch's fp32 attention) 3.1e-6; bf16 through oneDNN
# 2.8e-2 to 3.8e-2 by instruction set (up to 0.8 at logits near 23: bf16's last place there
# is 0.125). A GPU's bf16 (cuBLAS) is not measured here.
MAX_DRIFT = {ComputeMode.FP32: 1e-5, ComputeMode.FP16W: 1e-5, ComputeMode.FP16W_BF16: 1e-5, ComputeMode.BF16: 0.075}


@dataclass(frozen=True)
class Exactness:
    """A model's promise for greedy tokens: `row_exact` (token for token), else equal up to a
    near-tie with logits that move by at most `drift` of their row's largest |logit|."""

    mode: ComputeMode
    row_exact: bool

    @property
    def drift(self) -> float:
        return 0.0 if self.row_exact else MAX_DRIFT[self.mode]

    def tie_gap(self, logits: torch.Tensor) -> float:
        """Below this top-2 gap in plain decoding's `logits` [V], another run's greedy token may
        differ: each of the two logits may move by the drift, towards each other."""
        return 2.0 * self.drift * float(logits.abs().max())

    def describe(self) -> str:
        if self.row_exact:
            return f"{self.mode.value}: row-exact (greedy tokens equal alone, speculative and batched)"
        return f"{self.mode.value}: equal up to near-ties (logits drift up to {self.drift:g} of their largest)"


def exactness(mode: ComputeMode, row_kernels: bool) -> Exactness:
    """The promise of a model in `mode` whose short blocks do (`row_kernels`) or do not run the
    kernel build's row-exact linears and attention. fp32 is never row-exact: it is transformers'
    math, PyTorch's kernels."""
    return Exactness(mode, row_exact=row_kernels and mode is not ComputeMode.FP32)


@torch.inference_mode()
def row_drift(model, prompt_ids: torch.Tensor, continuation: Sequence[int], block_sizes: Sequence[int]) -> float:
    """The most a logit of `continuation`'s positions moves, relative to the largest |logit| of
    its row, between a one-row decode of each and verify blocks of `block_sizes` rows, run
    alone and pooled in one forward beside a second request. Zero for a row-exact model."""
    num_prompt = prompt_ids.numel()
    capacity = num_prompt + len(continuation) + 1
    pool = model.new_pool(2, capacity)
    caches = pool.acquire(capacity), pool.acquire(capacity)
    for cache in caches:
        model.prefill(cache, prompt_ids)
    ids = torch.tensor(list(continuation), dtype=torch.long)
    decoded = [
        model.forward(caches[0], ids[i : i + 1], num_prompt + i, logits="all").logits[0] for i in range(ids.numel())
    ]
    worst = 0.0
    for size in block_sizes:
        for beside in (False, True):
            for at in range(0, ids.numel(), size):
                block = ids[at : at + size]
                if beside:
                    rows = [RequestRows(caches[0], block, num_prompt + at), RequestRows(caches[1], ids[:1], num_prompt)]
                    logits = model.forward_batch(rows, logits="all")[0]
                else:
                    logits = model.forward(caches[0], block, num_prompt + at, logits="all").logits
                for alone, row in zip(decoded[at : at + size], logits):
                    worst = max(worst, float((row - alone).abs().max() / alone.abs().max()))
    for cache in caches:
        pool.release(cache)
    return worst
