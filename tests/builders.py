"""What tests build: tiny random checkpoints saved as safetensors, the bundled documents,
statistical checks, and small helpers that several rooms' tests share."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import torch

from pipeline.decoding.decode import decode
from pipeline.decoding.drafters import LayerSkipDrafter, NoDraft
from pipeline.decoding.loop import DecodeConfig, prefill
from pipeline.decoding.prompt_lookup import PromptLookupDrafter
from pipeline.decoding.sampling import SamplingParams
from pipeline.knapspec.drafter import KnapSpecDrafter, search_candidates
from pipeline.knapspec.latency import LatencyModel
from pipeline.knapspec.replanning import KnapSpecConfig

REPO = Path(__file__).resolve().parent.parent

SAMPLE_DOCS = REPO / "data" / "sample.jsonl"

# Big enough for grouped-query attention and a few layers, small enough to run in milliseconds.
TINY_COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

TINY_FAMILIES = {
    "llama": dict(model_type="llama"),
    "qwen3": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=True),  # head_dim != hidden / heads
    "qwen2": dict(model_type="qwen2"),  # q/k/v biases
    "mistral": dict(model_type="mistral", sliding_window=None),
}


def make_tiny_checkpoint(
    path: Path,
    family: str,
    seed: int = 0,
    init_scale: float = 1.0,
    logit_scale: float = 5.0,
    quiet_layers: tuple[int, ...] = (),
    **overrides,
) -> Path:
    """A random model of `family`, saved with save_pretrained (safetensors) as a user would have it.

    Weights are drawn larger than at initialization so that the model is confident and
    greedy choices are far from ties, as a trained model's usually are.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(TINY_COMMON, **TINY_FAMILIES[family], **overrides)
    model_type = settings.pop("model_type")
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "lm_head" in name or "embed_tokens" in name:
                p.normal_(0.0, logit_scale / p.shape[-1] ** 0.5)
            else:
                p.normal_(0.0, init_scale / p.shape[-1] ** 0.5)
        # Trained models are redundant: some sublayers barely move the residual stream,
        # which is what makes skipping them cheap in agreement. Random models are not.
        for layer in quiet_layers:
            block = model.model.layers[layer]
            block.self_attn.o_proj.weight.mul_(0.05)
            block.mlp.down_proj.weight.mul_(0.05)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_tiny(path: Path, mode: str = "fp32"):
    """(HF model, our SublayerModel) of a tiny checkpoint."""
    from pipeline.model import checkpoint
    from pipeline.model.linear import ComputeMode
    from pipeline.model.loading import model_from_tensors

    config = checkpoint.load_config(path)
    model = model_from_tensors(config, checkpoint.read_tensors(path), ComputeMode(mode))
    return checkpoint.load_hf_model(path), model


def sample_documents() -> list[dict]:
    return [json.loads(line) for line in SAMPLE_DOCS.read_text().splitlines() if line.strip()]


def chi_square_p_value(counts: dict, exact: dict, num_samples: int) -> float:
    """Goodness of fit of sampled sequences to their exact probabilities (profiling.gpu.checks.chi_square)."""
    from profiling.gpu.checks import chi_square

    return chi_square(counts, exact, num_samples)[2]


class SampleTally:
    """Sequences drawn by speculative sampling, with how much was drafted and accepted."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, ...], int] = {}
        self.drafted = self.accepted = 0

    def add(self, result) -> None:
        key = tuple(result.token_ids)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.drafted += result.stats.drafted_tokens
        self.accepted += result.stats.accepted_tokens

    def assert_follows(self, exact: dict) -> None:
        """The samples fit the exact law (χ²), and drafts were both accepted and rejected."""
        assert set(self.counts) <= set(exact), "sampled a sequence the model gives zero probability"
        assert 0.05 < self.accepted / self.drafted < 0.95, "the test must exercise both acceptance and rejection"
        p_value = chi_square_p_value(self.counts, exact, sum(self.counts.values()))
        assert p_value > 1e-3, f"speculative samples do not follow the model (p = {p_value:.2e})"


def exact_joint_law(model, prompt: torch.Tensor, params) -> dict[tuple[int, int, int], float]:
    """P(t1, t2, t3) of plain sampling after `prompt` (profiling.gpu.checks.exact_law)."""
    from profiling.gpu.checks import exact_law

    return exact_law(model, prompt, params)


# The tokenizer files of a chat model, copied next to a tiny model's weights.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def make_tiny_chat_checkpoint(path: Path, **overrides) -> Path:
    """A tiny random Llama that uses the embedded model's real tokenizer and chat template:
    whole jobs (tokenize, chunk, prompt, generate, decode) run on it in seconds."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pipeline.model import checkpoint

    embedded = checkpoint.resolve_checkpoint(None)
    tokenizer = checkpoint.load_tokenizer(embedded)
    settings = dict(vocab_size=len(tokenizer), max_position_embeddings=4096, num_hidden_layers=2)
    make_tiny_checkpoint(path, "llama", **(settings | overrides))
    for name in _TOKENIZER_FILES:
        if (embedded / name).is_file():
            shutil.copy(embedded / name, path / name)
    # A random model soon repeats one token, often a newline or an end token, and its
    # "summaries" would be empty. Zeroed head rows keep those tokens below the visible ones.
    weights = load_file(path / "model.safetensors")
    invisible = [i for i in range(len(tokenizer)) if not tokenizer.decode([i], skip_special_tokens=True).strip()]
    weights["lm_head.weight"][invisible] = 0.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


# A search that runs on tiny models: short reference, frequent re-planning, no confidence stop
# or time budget, a weak prior.
SEARCH_CONFIG = KnapSpecConfig(
    num_reference_tokens=8,
    reoptimize_every=6,
    max_draft=4,
    confidence_threshold=0.0,
    prior_strength=1.0,
    max_search_share=None,
    max_search_share_of_gain=None,
)


def synthetic_latency(num_layers: int, verify_growth: float) -> LatencyModel:
    """Attention dear relative to the MLP; verifying k tokens costs 1 + growth·(k − 1) of one."""
    return LatencyModel(
        attn_slope=2e-6,
        attn_base=4e-3,
        t_mlp=0.5e-3,
        t_fixed=0.2e-3,
        verify_ratios=tuple(1.0 + verify_growth * k for k in range(11)),
        num_layers=num_layers,
    )


def load_job(script: str, module_name: str):
    """A script of jobs/ (a folder of scripts, not a package) as a module, registered under
    `module_name` (its dataclasses look their module up in sys.modules)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(module_name, REPO / "jobs" / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def brute_force(values, weights, budget, always_execute=()):
    """For each exact skipped weight j <= budget, the most value kept (sum over executed items)."""
    skippable = [i for i in range(len(values)) if i not in always_execute]
    best: dict[int, float] = {}
    for size in range(len(skippable) + 1):
        for subset in itertools.combinations(skippable, size):
            weight = sum(weights[i] for i in subset)
            if weight <= budget:
                kept = sum(values) - sum(values[i] for i in subset)
                best[weight] = max(best.get(weight, float("-inf")), kept)
    return best


def random_knapsack(seed: int, num_items: int) -> tuple[list[float], tuple[int, ...]]:
    """Item magnitudes in [0.1, 2.1) and integer weights in 1..3: a small random knapsack."""
    g = torch.Generator().manual_seed(seed)
    magnitudes = (torch.rand(num_items, generator=g) * 2 + 0.1).tolist()
    return magnitudes, tuple(int(w) for w in torch.randint(1, 4, (num_items,), generator=g))


def random_prompt(seed: int, length: int = 48) -> torch.Tensor:
    return torch.randint(3, 96, (length,), generator=torch.Generator().manual_seed(seed))


def generate(model, prompt_ids, drafter, max_new=32) -> list[int]:
    """Greedy tokens of `drafter` on `model` (the whole model, or a pipelined one)."""
    prefilled = prefill(model, prompt_ids, max_new)
    result = decode(
        model, prefilled, DecodeConfig(max_new_tokens=max_new), SamplingParams(), drafter, prompt_ids.tolist()
    )
    return result.token_ids


def weight_skipped_per_stage(pipeline, weights: list[int], items_per_stage: int = 8) -> list[int]:
    """The weight (time) of each stage's items skipped, over all candidates of the uncapped DP
    (a branch cap keeps the best-scoring cells whatever their weight) on a random 200-token
    prompt. Not a count of items: where one stage's items weigh 1 and the other's 5, the DP fills
    the last units of each budget with light items, and counts come out even."""
    cache = pipeline.new_cache(300)
    ids = random_prompt(5, 200)
    pipeline.prefill(cache, ids[:192])
    exact = dataclasses.replace(SEARCH_CONFIG, max_branches=None)
    skipped = [0] * len(pipeline.links)
    for skip, _ in search_candidates(pipeline, cache, ids[192:200], 192, tuple(weights), exact):
        for item in skip:
            skipped[item // items_per_stage] += weights[item]
    pipeline.free_all()
    return skipped


def assert_same_or_near_tie(
    model, prompt: torch.Tensor, got: list[int], expected: list[int], params: SamplingParams = SamplingParams()
) -> None:
    """Tokens as the model's mode promises (pipeline/model/precision.py): equal where it is
    row-exact; else equal, or a first difference where the request alone had its top-2 logits
    within the mode's tie gap (after `params`' repetition control, which its greedy choice read)."""
    if got == expected:
        return
    promise = model.exactness
    first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    assert first < min(len(got), len(expected)), f"one stopped early: {len(got)} vs {len(expected)} tokens"
    assert not promise.row_exact, f"{promise.describe()}, yet token {first} differs: {got[first]} vs {expected[first]}"
    cache = model.new_cache(prompt.numel() + first + 1)
    logits = model.prefill(cache, torch.cat([prompt, torch.tensor(expected[:first], dtype=torch.long)]))
    repetition = params.repetition(prompt.tolist())
    if repetition is not None:
        repetition.extend(expected[:first])
        logits = repetition.process_row(logits)
    top2 = logits.topk(2).values
    gap, bound = float(top2[0] - top2[1]), promise.tie_gap(logits)
    assert gap < bound, f"token {first} differs without a near-tie (top-2 gap {gap:.2e}, {promise.describe()})"


def batch_through_captured_steps(model, settings, limits=(30, 12, 25, 6, 18)):
    """Mixed prompts, limits and drafters (copies, a fixed skip set, KnapSpec) in one continuous
    batch, against each request decoded alone plainly, both through `settings`' captured steps
    (pipeline/model/graphs: decode, verify, draft and prompt-chunk steps): each request's greedy
    tokens as the mode promises. (A captured prompt chunk's attention rounds otherwise than the
    eager prefill's: the promise holds within one route, as within one dtype; the steps' logits
    against the eager forward's are tests/model/test_graphs.py's.) Returns the batch's StepGraphs."""
    from pipeline.decoding.loop import DecodeConfig
    from pipeline.decoding.sampling import SamplingParams
    from pipeline.decoding.scheduler import ContinuousBatcher, GenerationRequest

    prompts = [repeating_prompt(n, seed).to(model.device) for seed, n in enumerate((5, 40, 90, 23, 60))]
    model.use_graphs(settings)

    def decoded(max_batch: int, drafters) -> list[list[int]]:
        batcher = ContinuousBatcher(model, max_batch=max_batch, slot_positions=160)  # (prompts chunked alike)
        tickets = [
            batcher.submit(GenerationRequest(p, DecodeConfig(m), SamplingParams(), d))
            for p, m, d in zip(prompts, limits, drafters)
        ]
        finished = {done.ticket: done for done in batcher.run()}
        for ticket in tickets:
            assert finished[ticket].error is None, finished[ticket].error
        decoded.graphs = batcher.pool.graphs
        return [finished[ticket].result.token_ids for ticket in tickets]

    expected = decoded(1, [None] * len(prompts))  # one at a time: each request alone
    got = decoded(4, mixed_drafters(model))
    for prompt, tokens, reference in zip(prompts, got, expected):
        assert_same_or_near_tie(model, prompt, tokens, reference)
    return decoded.graphs


def repeating_prompt(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, 96, (8,), generator=g)  # repeated, so that prompt lookup finds copies
    return torch.cat([torch.randint(3, 96, (n,), generator=g), phrase, torch.randint(3, 96, (4,), generator=g), phrase])


def mixed_drafters(model):
    """A mix of what requests bring into one batch: none, copies, a fixed skip set, KnapSpec."""
    items = model.spec.num_items
    return [
        NoDraft(),
        PromptLookupDrafter(),
        LayerSkipDrafter([2, 3], items, max_draft=3, confidence_threshold=0.0),
        KnapSpecDrafter(synthetic_latency(model.spec.num_layers, verify_growth=0.0), SEARCH_CONFIG),
        PromptLookupDrafter(),
    ]


def pooled_rows(spans, max_rows: int, kernel: bool = False):
    """The pooled layout a forward over `spans` (cache, start, rows) would make (packing.plan_pooled,
    moved to the pool's device as step_rows moves it), and the indices of the spans left out."""
    from pipeline.model.packing import plan_pooled
    from pipeline.model.staging import HostStaging

    plan, own = plan_pooled(spans, max_rows)
    if plan is None:
        return None, own
    return plan.on_device(HostStaging(plan.pool.keys.device).send(plan.parts), kernel), own
