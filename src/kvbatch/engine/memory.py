"""Memory model: price weights, KV pages and workspace before anything is allocated.

Every admission and every pool growth asks this module first; nothing in the
engine allocates KV memory it has not priced here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import psutil

from kvbatch.engine.config import KV_BITS, KVConfig, mode_name
from kvbatch.engine.sizes import fmt_bytes, parse_size
from kvbatch.engine.types import ModelSpec


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def available_memory() -> int:
    """What the machine can give right now: device free memory on a GPU, available RAM on the CPU.

    MLX 0.32 keys (mx.device_info(mx.gpu)): Metal has `max_recommended_working_set_size`
    and `memory_size`; CUDA has `free_memory` (NVML, device-wide; cudaMemGetInfo as
    fallback) and `total_memory`. Buffers in MLX's own cache count as available: MLX
    reuses them, or returns them with mx.clear_cache().
    """
    import mlx.core as mx

    cached = int(mx.get_cache_memory())
    if mx.metal.is_available():
        info = mx.device_info(mx.gpu)
        limit = int(info.get("max_recommended_working_set_size", 0) or info.get("memory_size", 0))
        return max(0, limit - int(mx.get_active_memory()))
    if mx.cuda.is_available():
        info = mx.device_info(mx.gpu)
        if "free_memory" in info:
            return int(info["free_memory"]) + cached
        total = int(info.get("total_memory", 0)) or psutil.virtual_memory().total
        return max(0, total - int(mx.get_active_memory()))
    return int(psutil.virtual_memory().available) + cached


def resolve_budget(budget: str | int, fraction: float = 0.8, headroom: str | int = "1GiB",
                   resident: int = 0) -> int:
    """Total bytes kvbatch may use (weights included): explicit, or `auto`.

    auto = resident + fraction x available_memory() - headroom, where `resident` is
    what this process already holds that the budget counts (the loaded weights:
    they are no longer in the machine's free memory, but they are part of the budget).
    """
    if isinstance(budget, str) and budget.strip().lower() == "auto":
        if not 0 < fraction <= 1:
            raise ValueError(f"memory.fraction must be in (0, 1], got {fraction}")
        return int(resident) + max(0, int(available_memory() * fraction) - parse_size(headroom))
    return parse_size(budget)


@dataclass(frozen=True)
class KVLayout:
    """Bytes of the KV cache for one model and one KV mode."""

    num_kv_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    mode: str  # none | q8 | q4 | k8v4
    group_size: int
    page_size: int
    key_bits: Optional[int] = None  # None: the mode's (config.KV_BITS)
    value_bits: Optional[int] = None
    full_precision_tokens: int = 0  # each row's first tokens also kept in full precision (a slot per row)
    rotate_keys: bool = False  # (costs no bytes; carried so the store and routes read one layout)

    def __post_init__(self) -> None:
        kb, vb = KV_BITS.get(self.mode, (None, None))
        object.__setattr__(self, "key_bits", self.key_bits or kb)
        object.__setattr__(self, "value_bits", self.value_bits or vb)

    @property
    def quantized(self) -> bool:
        """Whether pages are stored quantized (key_bits set)."""
        return self.key_bits is not None

    @property
    def label(self) -> str:
        """The mode by what it stores: q8, q4, k8v4 (or k<K>v<V>), +rot, +fp<N> (config.KVConfig.label)."""
        return mode_name(self.key_bits, self.value_bits) + ("+rot" if self.rotate_keys else "") + \
            (f"+fp{self.full_precision_tokens}" if self.full_precision_tokens else "")

    @property
    def bytes_per_token(self) -> int:
        """K and V, all KV layers; quantized modes include their scales and biases (one of each per
        group, keys and values at their own bits)."""
        if not self.quantized:
            return self.dense_bytes_per_token
        groups = 2 * (self.head_dim // self.group_size) * self.dtype_bytes
        assert self.key_bits is not None and self.value_bits is not None  # quantized: both set (__post_init__)
        per_head = self.head_dim * (self.key_bits + self.value_bits) // 8 + 2 * groups
        return self.num_kv_layers * self.num_kv_heads * per_head

    @property
    def slot_bytes(self) -> int:
        """Full-precision bytes each batch slot holds beside the pool (quantized modes): the page it
        is filling (its tail) and its first full_precision_tokens tokens."""
        if not self.quantized:
            return 0
        return (self.page_size + self.full_precision_tokens) * self.dense_bytes_per_token

    @property
    def dense_bytes_per_token(self) -> int:
        """Bytes a token's K and V take at the model's dtype, over every KV layer."""
        return 2 * self.num_kv_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes one page takes over every KV layer."""
        return self.page_size * self.bytes_per_token

    def pages_for(self, tokens: int) -> int:
        """Pages that hold `tokens` tokens (at least one)."""
        return max(1, math.ceil(tokens / self.page_size))


def kv_layout(spec: ModelSpec, mode: str, page_size: int, group_size: int, key_bits: Optional[int] = None,
              value_bits: Optional[int] = None, full_precision_tokens: int = 0,
              rotate_keys: bool = False) -> KVLayout:
    """The KV layout of `spec` in this mode: what a token, a page and a tail cost."""
    return KVLayout(len(spec.kv_layers), spec.num_kv_heads, spec.head_dim, DTYPE_BYTES[spec.dtype],
                    mode, group_size, page_size, key_bits, value_bits, full_precision_tokens, rotate_keys)


def layout_for(spec: ModelSpec, kv: KVConfig) -> KVLayout:
    """The layout a KV config stores."""
    kb, vb = kv.kv_bits
    return kv_layout(spec, kv.mode, kv.page_size, kv.group_size, kb, vb, kv.full_precision_tokens, kv.rotate_keys)


@dataclass(frozen=True)
class MemoryModel:
    """Prices a set of running rows: KV pages at their worst case plus the step workspace."""

    spec: ModelSpec
    layout: KVLayout
    budget: int
    prefill_chunk: int
    max_batch: int
    prefill_tokens: int = 0  # most tokens of one prefill pass (0: one chunk)
    decode_window: int = 1  # tokens of a row in one decode pass (1 + speculative.num_tokens: a verification)
    # speculative.method=draft: the draft model's own memory model (its weights, its KV layout in the same
    # mode and page size, its passes); a row's draft pages never outnumber its pages here, so each page
    # here is priced with a draft page beside it
    draft: Optional["MemoryModel"] = None
    # verification passes stay in flight (the lookahead): a pass's float32 logits live on while the next is
    # computed, until its outputs are applied
    window_in_flight: bool = False

    @property
    def weights_bytes(self) -> int:
        """The model's weights, and the draft model's."""
        return self.spec.weights_bytes + (self.draft.spec.weights_bytes if self.draft else 0)

    @property
    def page_bytes(self) -> int:
        """What one page costs: the layout's page, and the draft's page beside it."""
        return self.layout.page_bytes + (self.draft.layout.page_bytes if self.draft else 0)

    def workspace(self, rows: int, max_tokens: int, max_prompt: int | None = None) -> int:
        """Transient bytes of the largest pass (`step_workspace`), plus the quantized modes'
        full-precision slots: the page each batch slot is filling and its first
        full_precision_tokens tokens (KVLayout.slot_bytes); the draft's too."""
        ws, slots = self.step_workspace(rows, max_tokens, max_prompt), self.layout.slot_bytes
        d = self.draft
        if d is not None:  # the draft's passes run between this model's, never with them
            ws, slots = max(ws, d.step_workspace(rows, max_tokens, max_prompt)), slots + d.layout.slot_bytes
        return ws + self.max_batch * slots

    def step_workspace(self, rows: int, max_tokens: int, max_prompt: int | None = None) -> int:
        """Transient bytes of the largest forward pass (passes run one after another, never together).

        - decode (every row, one token, up to max_tokens of context): one layer's K/V of every
          row gathered from the pages (quantized pages: gathered and made contiguous, twice their
          bytes; dense: once, plus a float32 copy when a 2-byte dtype is upcast), float32 scores
          and probabilities, float32 logits (the engine computes last-position logits only); with
          speculative decoding, a pass of decode_window tokens a row with logits at every one (and,
          with window_in_flight, the logits of the pass before it, whose outputs are applied later);
        - prefill: the larger of a pass of one row's chunk (up to prefill_chunk tokens) at up to
          max_prompt tokens of context (None = max_tokens), and a pass of as many such chunks
          as prefill_tokens holds (up to `rows`) at the chunk's own length of context. The
          scheduler puts several rows' chunks into one pass only while `prefill_pass` stays
          within this, so short prompts batch and long ones run alone or nearly.
        """
        s, lay = self.spec, self.layout
        rows, T = max(rows, 1), max(max_tokens, 1)
        Tp = min(max_prompt, T) if max_prompt else T
        c = min(self.prefill_chunk, Tp)
        stored = lay.bytes_per_token // max(lay.num_kv_layers, 1)  # one token, one layer, K+V
        f32 = 2 * s.num_kv_heads * s.head_dim * 4
        per_token = 2 * stored if lay.quantized else stored + (f32 if lay.dtype_bytes < 4 else 0)
        decode = rows * T * per_token + 2 * rows * s.num_heads * T * 4 + 2 * rows * s.vocab_size * 4
        if self.decode_window > 1:  # a verification: a prefill pass of every decoding row, logits at each token
            W = self.decode_window
            logits = (3 if self.window_in_flight else 2) * rows * W * s.vocab_size * 4
            decode = max(decode, self.prefill_pass(rows, W, T) + logits)
        batched = min(rows, max(1, self.prefill_tokens // c))
        return max(decode, self.prefill_pass(1, c, Tp), self.prefill_pass(batched, c, c))

    def pass_room(self, pool_pages: int, rows: int, max_tokens: int, max_prompt: int | None = None) -> int:
        """Transient bytes a prefill pass may take now: the priced step workspace, or the room the budget has
        beyond the weights, a pool of `pool_pages` pages and the workspace (with the batch slots) of a decode
        step still in flight, whichever is larger. pool_pages: the most the pool can hold before the pass
        ends (its pages now, or what the running rows can ever need if larger: the pass's own chunks may grow
        it first); the next growth comes after the pass is evaluated."""
        ws = self.step_workspace(rows, max_tokens, max_prompt)
        room = self.budget - self.weights_bytes - pool_pages * self.page_bytes - self.workspace(rows, max_tokens,
                                                                                               max_prompt)
        return max(ws, room)

    def prefill_pass(self, rows: int, L: int, T: int) -> int:
        """Transient bytes of one prefill pass: `rows` rows right-padded to L tokens, each attending
        to at most T keys: one layer's K/V of each row as stored plus two float32 copies
        (dequantized/upcast, concatenated), float32 scores and probabilities, activations, logits."""
        s, lay = self.spec, self.layout
        stored = lay.bytes_per_token // max(lay.num_kv_layers, 1)
        f32 = 2 * s.num_kv_heads * s.head_dim * 4
        activations = 16 * s.num_heads * s.head_dim * 4  # about 16 float32 hidden vectors a token
        return rows * (T * (stored + 2 * f32) + 2 * s.num_heads * L * T * 4 + L * activations + 2 * s.vocab_size * 4)

    def bytes_for(self, worst_tokens: list[int], max_prompt: int | None = None, shared_pages: int = 0) -> int:
        """Weights + worst-case KV pages of these rows + the growth copy + workspace. shared_pages:
        holds of a page beyond its first (pages several rows share are priced once)."""
        if not worst_tokens:
            return self.weights_bytes
        return self.bytes_for_pages(sum(self.layout.pages_for(t) for t in worst_tokens) - shared_pages,
                                    len(worst_tokens), max(worst_tokens), max_prompt)

    def bytes_for_pages(self, pages: int, rows: int, max_tokens: int, max_prompt: int | None = None) -> int:
        """bytes_for from the rows' totals: their worst-case pages (shared holds taken off), how many
        rows, and the largest worst case (the scheduler keeps these as rows are admitted)."""
        if rows <= 0:
            return self.weights_bytes
        return self._total(pages * self.page_bytes, rows, max_tokens, max_prompt)

    def bytes_for_rows(self, n: int, worst_tokens: int, max_prompt: int | None = None) -> int:
        """bytes_for([worst_tokens] * n) without building the list (the plan searches up to millions of rows)."""
        if n <= 0:
            return self.weights_bytes
        return self._total(n * self.layout.pages_for(worst_tokens) * self.page_bytes, n, worst_tokens,
                           max_prompt)

    def _total(self, kv: int, rows: int, max_tokens: int, max_prompt: int | None) -> int:
        return self.weights_bytes + kv + self.growth_transient(kv) + self.workspace(rows, max_tokens, max_prompt)

    def growth_transient(self, kv_bytes: int) -> int:
        """Pool growth copies one layer at a time: one layer's new buffers coexist with the old."""
        return -(-kv_bytes // max(self.layout.num_kv_layers, 1))

    def fits(self, worst_tokens: list[int], max_prompt: int | None = None, shared_pages: int = 0) -> bool:
        """Whether these rows at their worst cases, with the weights and workspace, fit the memory budget."""
        return self.bytes_for(worst_tokens, max_prompt, shared_pages) <= self.budget

    def rows_that_fit(self, worst_tokens: int, max_prompt: int | None = None) -> int:
        """How many rows of this worst case fit at once (for the start-up plan)."""
        lo, hi = 0, 1
        def fits(n: int) -> bool:
            return self.bytes_for_rows(n, worst_tokens, max_prompt) <= self.budget

        lo, hi = 0, 1
        while hi < 1_000_000 and fits(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # fits(lo) holds, fits(hi) does not
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def plan(self, worst_tokens: int, max_prompt: int | None = None) -> dict:
        """The start-up plan for rows of `worst_tokens` (prompt + max_tokens) each."""
        n = self.rows_that_fit(worst_tokens, max_prompt)
        lay = self.layout
        return {
            "kv_mode": lay.label,
            "budget_bytes": self.budget,
            "weights_bytes": self.weights_bytes,
            "kv_bytes_per_token": lay.bytes_per_token + (self.draft.layout.bytes_per_token if self.draft else 0),
            "page_bytes": self.page_bytes,
            "row_worst_tokens": worst_tokens,
            "rows_fit": n,
            "rows_running": min(n, self.max_batch),  # what predicted_peak_bytes prices
            "predicted_kv_bytes_per_row": lay.pages_for(worst_tokens) * self.page_bytes,
            "workspace_bytes": self.workspace(max(min(n, self.max_batch), 1), worst_tokens, max_prompt),
            # total (weights + KV pages + growth copy + workspace) with the rows that can run at once
            # (rows_fit, at most max_batch) at their worst case
            "predicted_peak_bytes": self.bytes_for_rows(max(min(n, self.max_batch), 1), worst_tokens, max_prompt),
        }


def format_plan(plan: dict) -> str:
    """One line for the start of a run, from MemoryModel.plan / Engine.plan."""
    line = (f"memory plan: budget {fmt_bytes(plan['budget_bytes'])}, weights {fmt_bytes(plan['weights_bytes'])}, "
            f"KV ({plan['kv_mode']}) {plan['kv_bytes_per_token']} B/token, "
            f"{plan['rows_fit']} rows of {plan['row_worst_tokens']} tokens fit at once "
            f"(predicted peak {fmt_bytes(plan['predicted_peak_bytes'])} with {plan['rows_running']} running)")
    if "max_batch" in plan:
        runs = min(plan["max_batch"], plan["rows_fit"])
        line += (f"; batch: up to {plan['max_batch']} rows ({plan['max_batch_why']}), "
                 f"{runs} at their worst case")
        if plan["admission"] == "optimistic":
            line += ", more while answers are shorter (admission optimistic: preempts when memory runs out)"
        else:
            line += " (admission reserve)"
    if plan.get("prefix_cache"):
        line += "; prefix cache on (cached pages held by no row use the pool's free pages, evicted oldest first)"
    return line
