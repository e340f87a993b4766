"""N-gram proposals (vLLM's `ngram` method, "prompt lookup decoding"): the row's last n tokens are
looked up in its own earlier tokens (prompt and output), n from prompt_lookup_max down to
prompt_lookup_min; the tokens that followed the latest earlier occurrence are proposed.

Each row keeps an index of where every n-gram of prompt_lookup_min tokens of its sequence ends
(`NgramIndex`), extended by the tokens a step adds: a proposal looks up the row's last
prompt_lookup_min tokens there and checks only those places for the longer suffixes. The
verification pass waits for the proposals, with the GPU idle (a pass's next proposals need its
tokens), so their cost is on every pass: rescanning each row's whole sequence cost ~28 µs a row
on the H200 host (512 rows: ~5 ms a pass); the index costs a few µs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvbatch.engine.row import Row


@dataclass
class NgramIndex:
    """A row's tokens (prompt and output) and, for each n-gram of n_min tokens, the positions where it ends,
    in ascending order: all but the sequence's own last n-gram, which is the one looked up."""

    n_min: int
    toks: list[int] = field(default_factory=list)
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def extend(self, new: list[int]) -> None:
        """Append tokens; index the n-grams that now end before the last token."""
        toks, n = self.toks, self.n_min
        start = len(toks)
        toks.extend(new)
        for p in range(max(start - 1, n - 1), len(toks) - 1):
            self.ends.setdefault(tuple(toks[p - n + 1:p + 1]), []).append(p)

    def propose(self, k: int, n_max: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix (n_max down to
        n_min tokens) that occurred before; [] when none did."""
        toks, n_min = self.toks, self.n_min
        L = len(toks)
        if L < n_min + 1 or k <= 0:
            return []
        places = self.ends.get(tuple(toks[L - n_min:]))
        if not places:
            return []
        for n in range(min(n_max, L - 1), n_min - 1, -1):
            suffix = toks[L - n:L - n_min]  # what the place must also be preceded by
            for p in reversed(places):
                if p < n - 1:
                    break  # earlier places have fewer tokens before them
                if toks[p - n + 1:p - n_min + 1] == suffix:
                    return toks[p + 1:p + 1 + k]
        return []


class NgramProposer:
    """Proposals from each row's own tokens, through the row's NgramIndex (kept with the row in its
    RowSpec and brought up to date with its new tokens each step)."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    def index(self, row: Row) -> NgramIndex:
        """The row's index, extended by the tokens it gained since the last step."""
        st = row.spec
        assert st is not None, "a speculating row has its RowSpec"
        prompt, out = row.req.prompt_tokens, row.out
        idx = st.ngram
        if idx is None or len(idx.toks) > len(prompt) + len(out):  # new, or its tokens were cut: start again
            idx = st.ngram = NgramIndex(self.n_min)
        have = len(idx.toks)
        if have < len(prompt):
            idx.extend(list(prompt[have:]))
            have = len(prompt)
        if have < len(prompt) + len(out):
            idx.extend(list(out[have - len(prompt):]))
        return idx

    def propose(self, rows: list[Row], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens from rows[i]'s earlier tokens after its latest n-gram match."""
        return [self.index(row).propose(k, self.n_max) for row, k in zip(rows, ks)]

    def forget(self, everything: bool = False) -> None:
        """Nothing to drop: a row's index lives with the row."""

    def stats(self) -> dict:
        """No figures of its own."""
        return {}
