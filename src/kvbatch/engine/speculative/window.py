"""How many proposed tokens a row may have verified this step: the window a verification writes."""
from __future__ import annotations

from kvbatch.engine.row import Row


def speculates(row: Row) -> bool:
    """Whether the row may speculate at all. Rows whose next step needs host state built from each
    token in turn (a grammar's matcher, penalty counts) or whose tokens are forced do not."""
    return not (row.sampler.needs_host or row.forced is not None or row.score is not None)


def max_proposal(row: Row, k: int, context_length: int, page_size: int, quantized: bool) -> int:
    """At most k, and no more than the row can still output after the step's own token (max_tokens,
    context). With quantized pages the whole window stays in the row's dense tail page and never
    completes it: a sealed page is never rewritten, so a rollback only ever cuts into the tail, and
    a window that never crosses a page is read like decode (routes/quant.py `multi_plan`). So a row
    whose own token completes its page proposes nothing that step."""
    p = row.req.sampling
    n_out = len(row.out)
    k = min(k, p.max_tokens - n_out - 1, context_length - row.prompt_len - n_out - 1)
    if quantized:
        pos = row.kv.length  # where the pass's first token goes
        page_last = (pos // page_size + 1) * page_size - 1
        k = min(k, page_last - pos - 1)
    return max(k, 0)
