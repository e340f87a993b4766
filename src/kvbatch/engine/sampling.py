"""Per-row sampling over a batch of logits, in one set of MLX ops per step.

Each row's controls are columns of per-row vectors applied to the (B, V) float32 logits together;
a control no row in the step uses adds no op at all, so rows without controls cost what they
always did: one argmax for greedy rows, and for sampled rows the filters and Gumbel-max below.
Each sampled row keeps its own seeded key, split once per step (vmapped over the rows), so a
row's samples depend only on its seed and step, never on which rows share its batch.

Order, as vLLM applies them: penalties (engine/penalties.py), then the allowed-token mask (a
grammar's, engine/grammar.py; EOS and stop tokens before min_tokens), then for sampled rows
log-softmax, top_k, min_p, top_p (mlx-lm's apply_top_p; top_k and min_p as mlx-lm's pieces with a
per-row parameter), 1/temperature and the row's categorical draw. As in mlx-lm's sampler the
filters see the distribution before temperature.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Container, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_p

from kvbatch.engine import logprobs, penalties
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.reasoning import RowReasoning

if TYPE_CHECKING:
    from kvbatch.engine.grammar import Grammars

_split = mx.vmap(mx.random.split)


class RowSampler:
    """One row's sampling state: its key (sampled rows), its grammar matcher (constrained rows),
    the tokens masked before min_tokens, the prompt's distinct tokens (the repetition penalty), its
    reasoning block (rows with reasoning tags: the matcher is held there until the block closes)."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int] = (), eos_ids: frozenset = frozenset(),
                 matcher: Any = None):
        self.params = params
        self.greedy = params.temperature <= 0
        self.key = None if self.greedy else mx.random.key(params.seed)
        self.matcher = matcher
        self.penalized = penalties.used(params)
        self.counts = penalties.Counts()  # the output's token counts (penalized rows)
        self.prompt_ids = np.unique(np.asarray(prompt, dtype=np.int64)) \
            if penalties.on_prompt(params) else None
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.min_tokens_ban = np.array(sorted(banned), dtype=np.int64) if params.min_tokens and banned else None
        self.reasoning = None
        if params.reasoning is not None:
            self.reasoning = RowReasoning(params.reasoning, params.max_reasoning_tokens, prompt, matcher)
            if self.reasoning.open:
                self.matcher = None  # the answer's grammar: from the token after the closing tag
        # the host must know the row's last token before its next step (grammar state, penalty counts,
        # a reasoning block's end or forced closing tag)
        self.needs_host = matcher is not None or self.penalized \
            or (self.reasoning is not None and params.max_reasoning_tokens is not None)

    def skip(self, draws: int) -> None:
        """Move a sampled row's random stream past `draws` draws (a row resumed from a checkpoint
        of that many tokens): each draw splits the key once (_draw), so the stream's position is the
        number of tokens drawn."""
        if self.key is None or draws <= 0:
            return
        k = self.key
        for _ in range(draws):
            k = mx.random.split(k)[0]
        mx.eval(k)
        self.key = k


@dataclass
class Sampled:
    """A step's picks (lazy): tokens (B,); with logprobs asked by some rows, for those rows (`lp_rows`,
    indices into the step) the chosen token's log-probability and the top-K alternatives."""

    tokens: mx.array
    lp_rows: Optional[list[int]] = None
    lp: Optional[mx.array] = None  # (len(lp_rows),)
    top_ids: Optional[mx.array] = None  # (len(lp_rows), K), best first
    top_lps: Optional[mx.array] = None

    def arrays(self) -> list[mx.array]:
        """The step's arrays to evaluate (tokens, and logprobs where asked)."""
        return [a for a in (self.tokens, self.lp, self.top_ids, self.top_lps) if a is not None]


def sample_batch(logits: mx.array, rows: list, grammars: Optional[Grammars] = None,
                 ahead: Container[int] = frozenset(), steps: Optional[list[int]] = None,
                 keys: Optional[list] = None) -> Sampled:
    """logits (B, V) float32 -> the step's tokens (and logprobs). rows: the step's engine Rows, in order;
    ahead: ids of rows with a token in flight (lookahead: their step is len(out) + 1; such rows never
    need host state, see RowSampler.needs_host). steps, keys (a verification pass, where a row fills
    several entries, engine/speculative/verify.py): each entry's output step, and each sampled
    entry's key (the rows' own keys are then left as they are)."""
    samplers = [r.sampler for r in rows]
    pen, maybe_masked, sampled, lp_rows = [], [], [], []  # one pass over the rows: at large batches most are plain
    for i, s in enumerate(samplers):
        if s.penalized:
            pen.append(i)
        if s.matcher is not None or s.min_tokens_ban is not None or s.reasoning is not None:
            maybe_masked.append(i)
        if not s.greedy:
            sampled.append(i)
        if s.params.logprobs:
            lp_rows.append(i)
    x = logits
    if pen:
        V = x.shape[-1]
        x = penalties.apply(x, [(i, samplers[i].params, samplers[i].prompt_ids, samplers[i].counts.read(rows[i].out, V))
                                for i in pen])
    if steps is None:  # read only for rows with a mask or logprobs
        steps = [len(r.out) + (id(r) in ahead) for r in rows] if maybe_masked or lp_rows else []
    masked = [i for i in maybe_masked if (s := samplers[i]).matcher is not None
              or (s.min_tokens_ban is not None and steps[i] < s.params.min_tokens)
              or (s.reasoning is not None and s.reasoning.force is not None)]
    if masked:
        x = mx.where(allowed_mask(rows, masked, steps, grammars, x.shape[-1]), x, -mx.inf)
    tokens = mx.argmax(x, axis=-1)
    if sampled:
        picks = _draw(x if len(sampled) == len(rows) else x[mx.array(sampled)], [samplers[i] for i in sampled],
                      None if keys is None else [keys[i] for i in sampled])
        if len(sampled) == len(rows):
            tokens = picks
        else:
            tokens[mx.array(sampled)] = picks
    out = Sampled(tokens)
    if lp_rows:
        out.lp_rows = lp_rows
        chosen = [rows[i].forced[steps[i]] if rows[i].forced is not None and steps[i] < len(rows[i].forced)
                  else None for i in lp_rows]
        out.lp, out.top_ids, out.top_lps = logprobs.chosen_and_top(
            logits, tokens, lp_rows, len(rows), chosen, max(samplers[i].params.logprobs for i in lp_rows))
    return out


def allowed_mask(rows: list, masked: list[int], steps: list[int], grammars: Optional[Grammars],
                 vocab: int) -> mx.array:
    """(B, V) bool: the tokens each row may take this step. The host fills an int32 bitmask (32 tokens a
    word; rows without a mask all ones): constrained rows from llguidance, min_tokens bans cleared, a
    forced closing tag's token alone; MLX unpacks it on the device."""
    words = (vocab + 31) // 32
    bits = np.full((len(rows), words), -1, dtype=np.int32)
    constrained = [(rows[i].sampler.matcher, i) for i in masked if rows[i].sampler.matcher is not None]
    if constrained:
        assert grammars is not None, "constrained rows need the engine's grammars"
        grammars.fill(bits, constrained)
    flat = bits.view(np.uint32)
    for i in masked:
        s = rows[i].sampler
        if s.min_tokens_ban is not None and steps[i] < s.params.min_tokens:
            ban = s.min_tokens_ban[s.min_tokens_ban < vocab]
            np.bitwise_and.at(flat[i], ban // 32, ~(np.uint32(1) << (ban % 32).astype(np.uint32)))
        force = s.reasoning.force if s.reasoning is not None else None
        if force is not None and 0 <= force < vocab:
            flat[i] = 0
            flat[i, force // 32] = np.uint32(1) << np.uint32(force % 32)
    m = mx.array(flat)
    unpacked = (m[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
    return unpacked.reshape(len(rows), words * 32)[:, :vocab].astype(mx.bool_)


def _draw(x: mx.array, samplers: list[RowSampler], keys: Optional[list] = None) -> mx.array:
    """Sampled rows' tokens from their (Bs, V) logits: filters with per-row parameters, then each
    row's Gumbel-max draw with its own key (mx.random.categorical(l, key=k) == argmax(l + gumbel(k))).
    keys: this step's key of each row, given (else each row's key is split: the next, this step's)."""
    V = x.shape[-1]
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    ps = [s.params for s in samplers]
    ks = [p.top_k if 0 < p.top_k < V else 0 for p in ps]
    if any(ks):
        lp = top_k(lp, ks)
    if any(p.min_p > 0 for p in ps):
        lp = min_p(lp, [p.min_p for p in ps])
    if any(0 < p.top_p < 1 for p in ps):
        use = mx.array([0 < p.top_p < 1 for p in ps])[:, None]
        # mlx-lm annotates top_p as a float; a (Bs, 1) array broadcasts as one per row
        top_ps = mx.array([p.top_p for p in ps], dtype=mx.float32)[:, None]
        lp = mx.where(use, apply_top_p(lp, top_ps), lp)  # pyright: ignore[reportArgumentType]
    inv_t = mx.array([1 / p.temperature for p in ps], dtype=mx.float32)[:, None]
    if keys is None:
        # (Bs, 2, 2): [next key, this step's key]; every sampled row holds a key
        split = _split(mx.stack([s.key for s in samplers if s.key is not None]))
        for j, s in enumerate(samplers):
            s.key = split[j, 0]
        use = split[:, 1]
    else:
        use = mx.stack(keys)
    noise = mx.vmap(lambda k: mx.random.gumbel((V,), key=k))(use)
    return mx.argmax(lp * inv_t + noise, axis=-1)


def top_k(lp: mx.array, ks: list[int]) -> mx.array:
    """mlx-lm's apply_top_k with a k per row (0: off): keep each row's k best log-probabilities."""
    kmax = max(ks)
    best = mx.sort(mx.topk(lp, kmax, axis=-1), axis=-1)  # (B, kmax) ascending
    kth = mx.take_along_axis(best, mx.array([kmax - max(k, 1) for k in ks])[:, None], axis=-1)
    drop = (lp < kth) & mx.array([k > 0 for k in ks])[:, None]
    return mx.where(drop, -mx.inf, lp)


def min_p(lp: mx.array, mins: list[float]) -> mx.array:
    """mlx-lm's apply_min_p with a min_p per row (0: off): drop tokens below min_p x the top token's
    probability."""
    with np.errstate(divide="ignore"):
        floor = mx.array(np.log(np.asarray(mins, dtype=np.float32)))[:, None]  # log 0 = -inf: keeps all
    return mx.where(lp < lp.max(axis=-1, keepdims=True) + floor, -mx.inf, lp)
