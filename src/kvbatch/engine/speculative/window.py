"""How many proposed tokens a row may have verified this step: the window a verification writes."""
from __future__ import annotations

from kvbatch.engine.row import Row


def speculates(row: Row) -> bool:
    """Whether the row may speculate at all. Rows whose next step needs host state built from each
    token in turn (a grammar's matcher, penalty counts) or whose tokens are forced do not."""
    return not (row.sampler.needs_host or row.forced is not None or row.score is not None)


def max_proposal(row: Row, k: int, context_length: int, page_size: int, quantized: bool) -> int:
    """At most k, and no more than the row can still output after the step's own token (max_tokens,
    context). With quantized pages, a verification never completes (seals) a page holding a
    token not yet verified: a sealed page is never rewritten, so a rollback must only ever cut
    into the row's dense tail page. The pass's first token is the row's own (always kept), so it
    may seal a page it completes."""
    p = row.req.sampling
    n_out = len(row.out)
    k = min(k, p.max_tokens - n_out - 1, context_length - row.prompt_len - n_out - 1)
    if quantized:
        pos = row.kv.length  # where the pass's first token goes
        page_last = (pos // page_size + 1) * page_size - 1
        k = min(k, page_last - pos - 1 if pos < page_last else page_size - 1)
    return max(k, 0)
