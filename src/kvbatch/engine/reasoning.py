"""Reasoning blocks (`<think> ... </think>` before the answer): which tags a model uses, where a row's
block ends, the grammar held back until it does, the closing tag forced after `max_reasoning_tokens`,
and the text split into reasoning and answer.

As vLLM's reasoning parsers do, a row's response format constrains the answer only: its matcher waits
(`RowReasoning.matcher`) until the row outputs the closing tag's tokens, and starts from the token
after them. A row is in its block from its first token unless its prompt already closed one (its last
closing tag after its last opening tag: Qwen3's template with enable_thinking=false); a prompt that ends
inside a block (DeepSeek-R1's template ends with `<think>\\n`) or holds no tag at all starts in it.
The text split follows the same rule (`split`), so reasoning + closing tag + answer is the text,
with an opening tag the row wrote itself dropped from the reasoning.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

MODES = ("auto", "none")  # besides "START,END": the tags themselves


@dataclass(frozen=True)
class ReasoningTags:
    """A model's reasoning tags as text, and as the token ids the model writes them with."""

    start: str
    end: str
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]


def spec_problem(spec: Any) -> Optional[str]:
    """Why a job.reasoning value is unusable (None: it is usable): auto, none, or START,END."""
    if spec in MODES:
        return None
    if not isinstance(spec, str):
        return f"must be auto, none or START,END (the tags), got {spec!r}"
    start, sep, end = spec.partition(",")
    if not sep or not start.strip() or not end.strip() or "," in end:
        return "must be auto, none or START,END (two tags, e.g. '<think>,</think>')"
    return None


def tags_of(tokenizer: Any, spec: str, templated: bool = True) -> Optional[ReasoningTags]:
    """The tags `spec` names for this tokenizer (None: no reasoning). auto: mlx-lm's tags for the
    tokenizer's vocabulary (TokenizerWrapper.think_start / think_end), when its chat template writes
    them and the prompts go through it (`templated`: a block comes from the template); none: no
    reasoning; START,END: these tags, tokenized as the model writes them."""
    if spec == "none" or (spec == "auto" and not templated):
        return None
    if spec == "auto":
        start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
        template = getattr(tokenizer, "chat_template", None) or ""
        if not (start and end and isinstance(template, str) and end in template):
            return None
    else:
        start, _, end = (s.strip() for s in spec.partition(","))
    return ReasoningTags(start, end, _ids(tokenizer, start), _ids(tokenizer, end))


def _ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    out = tokenizer.encode(text, add_special_tokens=False)
    return tuple(int(t) for t in (out["input_ids"] if hasattr(out, "keys") else out))


def _rfind(seq: Sequence[int], sub: tuple[int, ...]) -> int:
    """The start of the last occurrence of `sub` in `seq` (-1: none)."""
    n = len(sub)
    for i in range(len(seq) - n, -1, -1):
        if tuple(seq[i:i + n]) == sub:
            return i
    return -1


def opens_in_block(prompt: Sequence[int], tags: ReasoningTags) -> bool:
    """Whether a row with this prompt starts inside its reasoning block: unless the prompt's last
    closing tag comes after its last opening tag."""
    end = _rfind(prompt, tags.end_ids)
    return end < 0 or _rfind(prompt, tags.start_ids) > end


class RowReasoning:
    """One row's place in its reasoning block: open or closed, its tokens so far, the closing tag's
    token it is forced to write next (max_reasoning_tokens), and the grammar held until it closes."""

    def __init__(self, tags: ReasoningTags, limit: Optional[int], prompt: Sequence[int], matcher: Any):
        self.tags, self.limit, self.matcher = tags, limit, matcher
        self.open = self.opened = opens_in_block(prompt, tags)
        self.tokens = 0  # tokens written inside the block
        self.forcing = -1  # index into end_ids of the closing tag's next forced token (-1: not forcing)
        if self.open and limit is not None and limit <= 0:
            self.forcing = 0

    @property
    def force(self) -> Optional[int]:
        """The token the row must write next (a closing tag being forced), or None."""
        return self.tags.end_ids[self.forcing] if self.open and self.forcing >= 0 else None

    def advance(self, out: list[int]) -> bool:
        """The row wrote out[-1] inside its block; True when that token closed the block (the grammar,
        held in `matcher`, applies from the next token)."""
        self.tokens += 1
        end = self.tags.end_ids
        if len(out) >= len(end) and tuple(out[-len(end):]) == end:
            self.open, self.forcing = False, -1
            return True
        if self.forcing >= 0:
            self.forcing += 1
        elif self.limit is not None and self.tokens >= self.limit:
            self.forcing = 0
        return False


def split(text: str, tags: ReasoningTags, opened: bool) -> tuple[Optional[str], str]:
    """(reasoning, answer) of a row's text: the reasoning is what precedes the first closing tag (an
    opening tag at its start dropped), the answer what follows it; a block never closed is all
    reasoning (the answer empty). A row that started after a closed block (`opened` False) has no
    reasoning (None) and its whole text is the answer."""
    if not opened:
        return None, text
    before, sep, after = text.partition(tags.end)
    head = before.lstrip()
    if head.startswith(tags.start):
        before = head[len(tags.start):]
    return before, after if sep else ""
