"""The engine's teacher-forced scorer: the log-probability of a given text after a prompt, under an
engine's cache, and (the sweep report's use) a KV cache's quality against the next-token distributions
another engine (kv=none) gives the same text. `action=score` (pipeline) scores datasets' completions
with the same TeacherForced rows (`request`).

Comparing free-running outputs turns one near-tie flip early in an answer into disagreement for the
rest of it. The measure llama.cpp and the literature use is teacher-forced: both caches are fed the
same tokens (the kv=none run's own output) and compared at every position: KL(reference || this),
whether both put the same token first, and the log-probability of the text under each.

A row is scored in one prefill-sized pass over prompt + text: the prompt is prefilled as the engine
prefills it, then the text in chunks that never cross a page boundary, so every scored token sees
the pages before its own as stored (sealed: quantized in q8/q4) and its own page at full precision,
exactly what a decode step sees. The logits come from the pass's hidden states (as prompt_logprobs,
engine/logprobs.py), a piece at a time; nothing is generated but the one token a prefill ends with.

The reference's log-probabilities are kept (float32, text tokens x vocabulary per row) while the
other engines score the same rows, so rows go in groups of at most `reference_bytes` of them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import mlx.core as mx
import numpy as np

from kvbatch.engine.logprobs import PIECE, logsumexp
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request


@dataclass(frozen=True)
class ForcedRow:
    """A row to score: its key, prompt tokens and the text (tokens) that follows the prompt."""

    key: str
    prompt: list[int]
    text: list[int]


@dataclass(frozen=True)
class RowQuality:
    """One row's text under an engine's cache, against the reference engine's distributions."""

    key: str
    positions: int  # text tokens scored
    kl_mean: float  # mean over positions of KL(reference || this), nats
    kl_max: float  # the largest KL at one position
    top1_agreement: float  # share of positions where both put the same token first
    nll: float  # mean -log p(text token) under this cache (perplexity: exp(nll))
    nll_reference: float  # the same under the reference
    error_code: Optional[str] = None  # the row could not be scored (the other fields are nan)


class TeacherForced:
    """One row's scorer, carried by its engine Row: chunking after the prompt, and what each prefill
    pass's hidden states give at the text's positions (lazy arrays, evaluated with the pass)."""

    def __init__(self, prompt_len: int, text: list[int], reference: Optional["TeacherForced"] = None,
                 keep: bool = False):
        """reference: the same row scored by the reference engine with keep=True (its log-probabilities
        kept): this row is compared with it. Without one, the row only records its own scores."""
        self.start, self.text, self.reference, self.keep = prompt_len, list(text), reference, keep
        self.parts: list[tuple[int, dict[str, mx.array]]] = []  # (first text index, arrays)
        self.logp: Optional[mx.array] = None  # keep: (len(text), vocab) float32, once complete
        self.error_code: Optional[str] = None

    def chunk(self, length: int, n: int, page_size: int) -> int:
        """Tokens of the next prefill chunk: the prompt as the engine chunks it, then the text one page at
        a time (a chunk ending at each page boundary: the next chunk sees that page as stored)."""
        if length + n <= self.start:
            return n
        if length < self.start:
            return self.start - length
        return min(n, page_size - length % page_size)

    def take(self, pos0: int, hidden: mx.array, head) -> list[mx.array]:
        """hidden (m, D): the pass's states at positions pos0.. of this row. Scores the positions whose
        next token is a text token; returns the lazy arrays to evaluate with the pass."""
        first = max(pos0, self.start - 1)
        last = min(pos0 + hidden.shape[0], self.start - 1 + len(self.text))
        if first >= last:
            return []
        t0 = first - (self.start - 1)  # index into the text of the first token predicted here
        self.parts = [p for p in self.parts if p[0] < t0]  # a preempted row prefills again from its start
        targets = mx.array(self.text[t0:t0 + last - first], dtype=mx.int32)
        out = []
        for a in range(0, last - first, PIECE):
            b = min(a + PIECE, last - first)
            lg = head(hidden[None, first - pos0 + a:first - pos0 + b])[0].astype(mx.float32)
            lq = lg - logsumexp(lg)
            got = {"chosen": mx.take_along_axis(lq, targets[a:b, None], axis=-1)[:, 0],
                   "top": mx.argmax(lq, axis=-1)}
            if self.keep:
                got["logp"] = lq
            if self.reference is not None and self.reference.logp is not None:
                lp = self.reference.logp[t0 + a:t0 + b]
                got["kl"] = (mx.exp(lp) * (lp - lq)).sum(axis=-1)
            self.parts.append((t0 + a, got))
            out += list(got.values())
        if self.keep and t0 + (last - first) == len(self.text):  # complete: one array, evaluated with the pass
            pieces = [p.pop("logp") for _, p in self.parts]
            self.logp = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)
            out.append(self.logp)
        return out

    def token_logprobs(self) -> Optional[list[float]]:
        """log p(text token | everything before it), per text token; None unless every token was scored."""
        got = self._cat("chosen")
        return [float(x) for x in got] if len(got) == len(self.text) else None

    def _cat(self, name: str) -> np.ndarray:
        return np.concatenate([np.asarray(p[name]) for _, p in self.parts]) if self.parts else np.zeros(0)

    def quality(self, key: str) -> RowQuality:
        """This row against its reference (both complete)."""
        ref = self.reference
        bad = self.error_code or (ref.error_code if ref is not None else None)
        n = len(self.text)
        if bad or ref is None or sum(len(p["chosen"]) for _, p in self.parts) != n:
            nan = math.nan
            return RowQuality(key, n, nan, nan, nan, nan, nan, bad or "internal_error")
        kl = np.maximum(self._cat("kl"), 0.0)  # float rounding can leave -1e-9 where both are equal
        same = self._cat("top") == ref._cat("top")
        return RowQuality(key, n, float(kl.mean()), float(kl.max()), float(same.mean()),
                          float(-self._cat("chosen").mean()), float(-ref._cat("chosen").mean()))

    def release(self) -> None:
        """Drop the kept log-probabilities (the group is done)."""
        self.logp, self.parts = None, []


def request(key: str, prompt: list[int], text: list[int]) -> tuple[Request, TeacherForced]:
    """The engine request that scores `text` (non-empty) after `prompt` (non-empty), and its scorer: add
    both with engine.add(req, score=scorer). The row stores prompt + text but its last token, and
    samples one token (ignored)."""
    sc = TeacherForced(len(prompt), text)
    return Request(key, list(prompt) + list(text[:-1]), SamplingParams(max_tokens=1)), sc


def score(engine, rows: list[ForcedRow], reference: Optional[dict[str, TeacherForced]] = None,
          keep: bool = False) -> dict[str, TeacherForced]:
    """Score `rows` (each with a non-empty text) on `engine`, batched as it batches prefill; against
    `reference` (scorers from score(..., keep=True) on the reference engine) when given. The engine
    must have nothing else waiting or running."""
    scorers: dict[str, TeacherForced] = {}
    for r in rows:
        req, sc = request(r.key, r.prompt, r.text)
        sc.reference, sc.keep = reference[r.key] if reference is not None else None, keep
        scorers[r.key] = sc
        engine.add(req, score=sc)
    for res in engine.run():
        if not res.ok:
            scorers[res.key].error_code = res.error_code
    return scorers


def groups(rows: list[ForcedRow], vocab_size: int, reference_bytes: int) -> list[list[ForcedRow]]:
    """Rows in order, in groups whose kept reference log-probabilities (float32) fit reference_bytes
    (a row larger than that alone)."""
    out: list[list[ForcedRow]] = []
    used = reference_bytes + 1
    for r in rows:
        need = len(r.text) * vocab_size * 4
        if used + need > reference_bytes and (not out or out[-1]):
            out.append([])
            used = 0
        out[-1].append(r)
        used += need
    return out


def compare(reference_engine, engines: Mapping[str, object], rows: list[ForcedRow],
            reference_bytes: int = 1 << 30) -> dict[str, dict[str, RowQuality]]:
    """Every row's text under each of `engines` against `reference_engine` (kv=none): name -> row key ->
    RowQuality. Rows without text are left out. Each group of rows is scored once on the reference."""
    rows = [r for r in rows if r.text]
    out: dict[str, dict[str, RowQuality]] = {name: {} for name in engines}
    for group in groups(rows, reference_engine.spec.vocab_size, reference_bytes):
        ref = score(reference_engine, group, keep=True)
        for name, eng in engines.items():
            for key, sc in score(eng, group, reference=ref).items():
                out[name][key] = sc.quality(key)
        for sc in ref.values():
            sc.release()
    return out


def summarize(rows: list[RowQuality]) -> dict:
    """Per job: rows scored and positions; KL mean over positions and max over rows' means and over
    positions; top-1 agreement over positions; perplexity of the text under this cache and under the
    reference (exp of the mean negative log-likelihood over positions)."""
    ok = [r for r in rows if r.error_code is None and r.positions]
    n = sum(r.positions for r in ok)
    if not n:
        return {"tf_rows": len(ok), "tf_positions": 0}
    w = lambda f: sum(getattr(r, f) * r.positions for r in ok) / n  # noqa: E731
    return {"tf_rows": len(ok), "tf_positions": n, "tf_kl_mean": w("kl_mean"),
            "tf_kl_row_max": max(r.kl_mean for r in ok), "tf_kl_max": max(r.kl_max for r in ok),
            "tf_top1_agreement": w("top1_agreement"), "tf_ppl": math.exp(w("nll")),
            "tf_ppl_baseline": math.exp(w("nll_reference"))}
