"""Chained verification passes: the next pass built from the pass in flight before its tokens are read.

A verification pass waits for the host: after reading a pass's tokens the host finds each row's accepted
tokens, looks its next proposal up and builds the next pass, while the device idles. A plain decode step
does not wait (the lookahead builds step N+1 on step N's unread token), and on a GPU at ~1,000 rows that
wait is most of a pass (docs/performance.md). Here the whole hand-over happens on the device, as array
operations on the pass's unread outputs: each row's accepted count (its proposal against the tokens
sampled before each position), its last token, its next position, its history extended with what it kept
and the n-gram search over it (ngram_device.py). The next pass is built from those lazy arrays and handed
to the device behind the pass in flight; the host then reads the older pass while the newer one computes.

What the host cannot know before the read, it takes at its furthest: every row's window has one width (its
token and as many positions as the longest proposal of the last pass read, at least one, at most k; a row's
proposal past them is cut, and a position without a proposal holds token 0 and is verified like any other,
kept only where the model's own token is 0 there), and its pages are reserved as if the pass in
flight kept all its tokens. Reading that pass then cuts each row back to what it kept plus the chained
window (Verifier.land). Rows whose prompt has just finished join with their last token (as if they had been
in the pass in flight with that token alone, kept), narrowing the window to their room; a row of the pass in
flight without room for a window past that pass's tokens at their most (max_tokens, context) sits the
chained pass out and joins the next. A chained pass holds only rows that decode greedily with no per-step
host state (no grammar, penalties, min_tokens mask or reasoning budget still pending), and needs a route
that plans windows at device positions (Route.chained_plan: kv none). A pass that ends a row (EOS, a stop)
is read after the next one is sent: that row's chained tokens are computed and dropped, as a plain lookahead
step's are.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class ChainState:
    """What a pass leaves on the device for the pass chained after it, row by row in the pass's order."""

    tokens: mx.array  # (B, W) the token sampled at each window position (past a row's window: its last one)
    props: mx.array  # (B, W - 1) the proposal each position verified, -1 past the row's proposal
    pos: mx.array  # (B,) int32 the window's first position
    hist: mx.array  # (B,) int32 the row's n-gram history length (it ends with the window's first input token)
    slots: mx.array  # (B,) int32 the row's n-gram history slot
    bound: int  # the most tokens any of these histories can hold after the window's (host's upper bound)


def host_state(tokens: mx.array, offs: list[int], lens: list[int], props: list[list[int]], pos: list[int],
               slots: list[int], hist: list[int]) -> ChainState:
    """The ChainState of a pass built on the host: its flat sampled tokens (lazy), each row's window offset
    and length, proposals, first position, and n-gram slot and history length."""
    W = max(lens)
    at = [[o + min(j, n - 1) for j in range(W)] for o, n in zip(offs, lens)]
    padded = [p + [-1] * (W - 1 - len(p)) for p in props]
    return ChainState(tokens[mx.array(at)], mx.array(padded, dtype=mx.int32).reshape(len(props), W - 1),
                      mx.array(pos, dtype=mx.int32), mx.array(hist, dtype=mx.int32), mx.array(slots, dtype=mx.int32),
                      max(hist) + W)


def joined_state(last: list[int], pos: list[int], slots: list[int], hist: list[int], W: int) -> ChainState:
    """The state of rows that join a chained pass from the host (their prompt just finished, or the pass in
    flight did not hold them): each as if it had been in the pass in flight with only its last token, kept
    (no proposal: accepted 0), so the chained pass takes that token at its position `pos` (its stored length)
    and its history (`hist` tokens, the last one that token) stays as it is."""
    B = len(last)
    return ChainState(mx.array([[t] * W for t in last], dtype=mx.int32), mx.full((B, W - 1), -1, dtype=mx.int32),
                      mx.array(pos, dtype=mx.int32) - 1, mx.array(hist, dtype=mx.int32) - 1,
                      mx.array(slots, dtype=mx.int32), max(hist) + W)


def concat(a: ChainState, b: ChainState) -> ChainState:
    """The rows of a, then those of b."""
    return ChainState(mx.concatenate([a.tokens, b.tokens.astype(a.tokens.dtype)]), mx.concatenate([a.props, b.props]),
                      mx.concatenate([a.pos, b.pos]), mx.concatenate([a.hist, b.hist]),
                      mx.concatenate([a.slots, b.slots]), max(a.bound, b.bound))


def accepted(tokens: mx.array, props: mx.array) -> mx.array:
    """(B,) int32: each row's accepted proposed tokens, on the device (verify.accepted_prefix of every row)."""
    if props.shape[1] == 0:
        return mx.zeros((tokens.shape[0],), dtype=mx.int32)
    same = (tokens[:, :-1] == props).astype(mx.int32)
    return mx.cumprod(same, axis=1).sum(axis=1).astype(mx.int32)


def select(s: ChainState, keep: list[int]) -> ChainState:
    """The state of the rows at `keep` (the rows that go on into the chained pass), in that order."""
    if keep == list(range(s.pos.shape[0])):
        return s
    i = mx.array(keep, dtype=mx.int32)
    return ChainState(s.tokens[i], s.props[i], s.pos[i], s.hist[i], s.slots[i], s.bound)
