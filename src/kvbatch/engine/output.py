"""What a step's tokens do to their rows: stop rules, detokenizing, a row's result and stats.

`accept` applies one step's sampled tokens (or the hooks' forced tokens) to its rows and returns
the rows that ended (the engine takes them out of the batch); `finish` ends a row: its pages go
back to the pool (zeroed first after an error, whose K/V may be NaN), its text is decoded and
cut at a stop string, and its Result is queued.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Optional, cast

import mlx.core as mx

from kvbatch.engine import errors, grammar, reasoning
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.kv.cache import PagedKVCache
from kvbatch.engine.memory import KVLayout
from kvbatch.engine.row import Row
from kvbatch.engine.sampling import Sampled
from kvbatch.engine.types import ModelSpec, Result, RowStats


class OutputProcessor:
    """Applies each step's tokens to its rows (stop rules, detokenizing) and builds the results of the rows that end."""

    def __init__(self, tokenizer, spec: ModelSpec, layout: KVLayout, cache: PagedKVCache, hooks: EngineHooks):
        self.tokenizer, self.spec, self.layout, self.cache, self.hooks = tokenizer, spec, layout, cache, hooks
        self.eos_ids = frozenset(getattr(tokenizer, "eos_token_ids", None) or [])
        self.done: deque[Result] = deque()
        self.generated_tokens = 0
        self.results_by_code: dict[str, int] = {}

    def accept(self, rows: list[Row], logits: mx.array, sampled: Sampled, finite: mx.array,
               read: Optional[tuple[list[int], list[bool]]] = None) -> list[Row]:
        """Apply a pass's tokens to its rows (row i: token i, logits i); the rows that ended. read: the
        tokens and finite flags, where the host holds them already (else read from the arrays)."""
        ended: list[Row] = []
        end = self._ender(ended)
        now = time.perf_counter()
        toks, ok = read if read is not None else \
            (cast(list[int], sampled.tokens.tolist()), cast(list[bool], finite.tolist()))
        lps = self._logprobs(sampled)
        capture, eos = self.hooks.capture_logits, self.eos_ids
        accepted = 0
        for i, r in enumerate(rows):
            if r.ended:  # lookahead: the row stopped on its previous token; this step's output is dropped
                continue
            if not ok[i]:
                nan = cast(int, mx.isnan(logits[i]).sum().item())
                inf = cast(int, mx.isinf(logits[i]).sum().item())
                end(r, "error", errors.NON_FINITE_LOGITS,
                         f"non-finite logits at output step {len(r.out)}: {nan} NaN, {inf} inf")
                continue
            if capture and r.req.key in capture:
                self.hooks.logits.setdefault(r.req.key, []).append(logits[i])
            forced = r.forced
            tok = forced[len(r.out)] if forced is not None and len(r.out) < len(forced) else toks[i]
            if r.t_first is None:
                r.t_first = now
            r.t_last = now
            p = r.req.sampling
            if forced is None and tok in p.stop_token_ids:
                end(r, "stop", stop_reason=str(tok))
                continue
            if forced is None and tok in eos and not p.ignore_eos:
                end(r, "stop")
                continue
            r.out.append(tok)
            accepted += 1
            if lps and i in lps and r.logprobs is not None:
                lp, top = lps[i]
                r.logprobs.tokens.append(lp)
                r.logprobs.top.append(top[:p.logprobs])
            matcher = r.sampler.matcher
            if matcher is not None:
                refused = grammar.advance(matcher, tok)
                if refused:
                    end(r, "error", errors.INVALID_INPUT, f"the response_format cannot go on: {refused}")
                    continue
            thinking = r.sampler.reasoning
            if thinking is not None and thinking.open and thinking.advance(r.out):
                r.sampler.matcher = thinking.matcher  # the block closed: the answer's grammar from the next token
            hit = self._hit_stop_string(r) if p.stop and len(r.out) > p.min_tokens else None
            if hit is not None:
                end(r, "stop", stop_reason=hit)
            elif matcher is not None and matcher.is_stopped():
                end(r, "stop")  # the grammar is complete: only EOS could follow
            elif len(r.out) >= r.end_at:
                end(r, "length")
        self.generated_tokens += accepted
        return ended

    def stops_on(self, row: Row, tokens) -> bool:
        """Whether one of these tokens, sampled for the row, ends it (a stop token, or EOS where it counts)."""
        p = row.req.sampling
        return any(t in p.stop_token_ids or (t in self.eos_ids and not p.ignore_eos) for t in tokens)

    def _ender(self, ended: list[Row]):
        """finish(), noting each row it ends in `ended`."""
        def end(row: Row, reason: str, code: Optional[str] = None, msg: Optional[str] = None,
                stop_reason: Optional[str] = None) -> None:
            ended.append(row)
            self.finish(row, reason, code, msg, stop_reason)
        return end

    @staticmethod
    def _logprobs(sampled: Sampled) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        """{row index in the step: (chosen token's logprob, [(id, logprob)] best first)}."""
        if not sampled.lp_rows or sampled.lp is None or sampled.top_ids is None or sampled.top_lps is None:
            return {}
        lp = cast(list[float], sampled.lp.tolist())
        ids = cast(list[list[int]], sampled.top_ids.tolist())
        vals = cast(list[list[float]], sampled.top_lps.tolist())
        return {i: (lp[j], list(zip(ids[j], vals[j]))) for j, i in enumerate(sampled.lp_rows)}

    def _hit_stop_string(self, r: Row) -> Optional[str]:
        """The stop string the row's latest tokens end in, if any."""
        window = max(len(s) for s in r.req.sampling.stop) + 8
        tail = self.tokenizer.decode(r.out[-window:])
        found = [s for s in r.req.sampling.stop if s in tail]
        return min(found, key=tail.index) if found else None

    def finish(self, row: Row, reason: str, code: Optional[str] = None, msg: Optional[str] = None,
               stop_reason: Optional[str] = None) -> None:
        """End a row: its result queued in `done`, its pages released (the caller takes a running
        row out of the batch)."""
        row.ended = True
        peak_kv = row.kv.peak_pages * self.layout.page_bytes
        if row.kv.tail is not None or (self.layout.quantized and row.kv.peak_pages):
            peak_kv += self.layout.slot_bytes
        if reason == "error":  # its K/V may be NaN/inf: zeroed before the pages are reused
            self.cache.release(row.kv, scrub=True)
        else:  # its full pages stay cached (prefix caching)
            self.cache.release(row.kv, tokens=row.seq)
        text = self.tokenizer.decode(row.out) if row.out else ""
        p = row.req.sampling
        if reason == "stop" and stop_reason in p.stop:  # cut where the stop string starts (after min_tokens)
            floor = len(self.tokenizer.decode(row.out[:p.min_tokens])) if p.min_tokens else 0
            at = text.find(stop_reason, max(0, floor - len(stop_reason) + 1))
            text = text[:at] if at >= 0 else text
        n = len(row.out)
        made = n - row.resumed  # generated since its admission (a resumed row's kept tokens are not)
        decode_tps = None
        if made > 1 and row.t_last and row.t_first and row.t_last > row.t_first:
            decode_tps = (made - 1) / (row.t_last - row.t_first)
        stats = RowStats(prompt_tokens=row.prompt_len, output_tokens=n,
                         ttft_s=(row.t_first - row.t_admit) if row.t_first and row.t_admit else None,
                         queue_s=(row.t_admit - row.t_submit) if row.t_admit else None,
                         preemptions=row.preemptions, cached_tokens=row.cached_tokens, resumed_tokens=row.resumed,
                         decode_tps=decode_tps, wall_s=time.perf_counter() - row.t_submit,
                         peak_kv_bytes=peak_kv, route=self.cache.route)
        if row.spec is not None:
            stats.spec_proposed, stats.spec_accepted = row.spec.proposed, row.spec.accepted
        key = code or "ok"
        self.results_by_code[key] = self.results_by_code.get(key, 0) + 1
        res = Result(row.req.key, list(row.out), text, reason, code, msg, stats, stop_reason, row.logprobs)
        thinking = row.sampler.reasoning
        if thinking is not None:
            res.reasoning, res.answer = reasoning.split(text, thinking.tags, thinking.opened)
        self.done.append(res)
