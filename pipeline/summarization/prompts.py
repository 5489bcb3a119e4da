"""Summarization prompts built with the tokenizer's chat template, and the instructions they carry."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.errors import ConfigError, RowError

DEFAULT_INSTRUCTION = "Summarize the following document in a few sentences.\n\n{document}"
# By SummaryRequest.kind (chunking.py): a document that fits one request, a part of a longer one,
# a part of joined summaries still too long for one request, and joined summaries that fit one.
INSTRUCTIONS = {
    "document": DEFAULT_INSTRUCTION,
    "part": "Summarize the following part of a longer document in a few sentences.\n\n{document}",
    # The reduce steps ask for notes to be merged: asked to "summarize the following summaries",
    # SmolLM2 often repeats the instruction or calls the text "a continuation of the previous
    # document". Chosen by measurement (jobs/summary_quality.py; docs/summary-quality.md).
    "part-summaries": (
        "Below are notes on consecutive parts of a long document. Merge them into shorter notes, "
        "keeping each main point once.\n\n{document}"
    ),
    "summaries": (
        "Below are notes on consecutive parts of one document. Write one short summary of the whole "
        "document from them: its subject and main points, each said once.\n\n{document}"
    ),
}

# Room left when re-tokenizing a cut document: a cut can merge or split a token or two.
_CUT_MARGIN = 8


@dataclass(frozen=True)
class Prompt:
    token_ids: torch.Tensor  # [T]
    truncated: bool
    document_tokens: int  # tokens of the whole document, before any cut


def build_prompt(
    tokenizer,
    document: str,
    max_prompt_tokens: int | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
) -> Prompt:
    """The chat-formatted summarization prompt, the document cut to fit `max_prompt_tokens`."""
    if "{document}" not in instruction:
        raise ConfigError("the instruction template must contain '{document}'")
    if not isinstance(document, str) or not document.strip():
        raise RowError("the document is empty")
    doc_ids = tokenizer.encode(document, add_special_tokens=False)
    ids = _encode_chat(tokenizer, instruction.format(document=document))
    if max_prompt_tokens is None or len(ids) <= max_prompt_tokens:
        return Prompt(torch.tensor(ids), truncated=False, document_tokens=len(doc_ids))
    overhead = len(ids) - len(doc_ids)
    keep = max_prompt_tokens - overhead - _CUT_MARGIN
    if keep < 1:
        raise ConfigError(f"max context of {max_prompt_tokens} tokens leaves no room for the document")
    while True:
        text = tokenizer.decode(doc_ids[:keep])
        ids = _encode_chat(tokenizer, instruction.format(document=text))
        if len(ids) <= max_prompt_tokens:
            return Prompt(torch.tensor(ids), truncated=True, document_tokens=len(doc_ids))
        keep -= len(ids) - max_prompt_tokens
        if keep < 1:
            raise ConfigError(f"max context of {max_prompt_tokens} tokens leaves no room for the document")


def _encode_chat(tokenizer, content: str) -> list[int]:
    messages = [{"role": "user", "content": content}]
    if tokenizer.chat_template:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(out["input_ids"])
    return tokenizer.encode(content)
