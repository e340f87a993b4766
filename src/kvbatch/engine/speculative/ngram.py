"""N-gram proposals (vLLM's `ngram` method, "prompt lookup decoding"): the row's last n tokens are
looked up in its own earlier tokens (prompt and output), n from prompt_lookup_max down to
prompt_lookup_min; the tokens that followed the latest earlier occurrence are proposed.

Each row keeps an index of where every n-gram of prompt_lookup_min tokens of its sequence ends
(`NgramIndex`), extended by the tokens a step adds: a proposal looks up the row's last
prompt_lookup_min tokens there and checks only those places for the longer suffixes.

The next pass's proposals need the tokens the pass in flight keeps, so they are on the pass's
critical path (the device waits while the host makes them: ~5 µs a row, ~5 ms a pass at 1,024 rows).
While a pass is in flight (`prepare`), each proposing row's index is extended by the tokens the pass is
expected to keep (its proposal, then the token that followed it where it was found) and the next
proposal is looked up there. When the pass keeps exactly those tokens, as it does for most rows of a
rewrite, the next proposal is that one; otherwise the guessed tokens are cut from the index and the
row's own tokens indexed, as without `prepare`. Either way a proposal depends only on the row's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvbatch.engine.row import Row


@dataclass
class NgramIndex:
    """A row's tokens (prompt and output) and, for each n-gram of n_min tokens, the positions where it ends,
    in ascending order: all but the sequence's own last n-gram, which is the one looked up. The tokens from
    `confirmed` on are a guess (`NgramProposer.prepare`)."""

    n_min: int
    toks: list[int] = field(default_factory=list)
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    confirmed: int = 0
    ready: Optional[int] = None  # match() of the tokens as they are, found ahead (None: not looked up)
    place: int = -1  # where the last proposal was found (its tokens follow this position)

    def extend(self, new: list[int]) -> None:
        """Append tokens; index the n-grams that now end before the last token."""
        toks, n = self.toks, self.n_min
        start = len(toks)
        toks.extend(new)
        for p in range(max(start - 1, n - 1), len(toks) - 1):
            self.ends.setdefault(tuple(toks[p - n + 1:p + 1]), []).append(p)
        self.ready = None

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens: the places of the n-grams that ended past them are dropped (each the
        last of its list, as places are appended in order)."""
        toks, n = self.toks, self.n_min
        for p in range(len(toks) - 2, max(length - 1, n - 1) - 1, -1):
            key = tuple(toks[p - n + 1:p + 1])
            places = self.ends[key]
            places.pop()
            if not places:
                del self.ends[key]
        del toks[length:]
        self.ready = None

    def match(self, n_max: int) -> int:
        """Where the latest earlier occurrence of the longest suffix (n_max down to n_min tokens) that occurred
        before ends; -1 when none did."""
        toks, n_min = self.toks, self.n_min
        L = len(toks)
        if L < n_min + 1:
            return -1
        places = self.ends.get(tuple(toks[L - n_min:]))
        if not places:
            return -1
        for n in range(min(n_max, L - 1), n_min - 1, -1):
            suffix = toks[L - n:L - n_min]  # what the place must also be preceded by
            for p in reversed(places):
                if p < n - 1:
                    break  # earlier places have fewer tokens before them
                if toks[p - n + 1:p - n_min + 1] == suffix:
                    return p
        return -1

    def after(self, place: int, k: int) -> list[int]:
        """Up to k tokens that follow position `place` ([] for no place, -1)."""
        return self.toks[place + 1:place + 1 + k] if place >= 0 else []

    def propose(self, k: int, n_max: int) -> list[int]:
        """Up to k tokens that followed the match (`match`); [] when there is none."""
        return self.after(self.match(n_max), k) if k > 0 else []


class NgramProposer:
    """Proposals from each row's own tokens, through the row's NgramIndex (kept with the row in its
    RowSpec and brought up to date with its new tokens each step)."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.prepared = 0  # rows whose next proposal was looked up while their pass was in flight
        self.prepared_used = 0  # ... and was the proposal (the pass kept the guessed tokens)

    def index(self, row: Row) -> NgramIndex:
        """The row's index, holding exactly the row's tokens: a guessed tail kept as far as the row's tokens
        agree with it, then extended by the tokens it gained since."""
        st = row.spec
        assert st is not None, "a speculating row has its RowSpec"
        prompt, out = row.req.prompt_tokens, row.out
        total, P = len(prompt) + len(out), len(prompt)
        idx = st.ngram
        if idx is not None and idx.confirmed < len(idx.toks):  # a guess (prepare): keep what the row confirms
            toks, n = idx.toks, idx.confirmed
            while n < len(toks) and n < total and toks[n] == out[n - P]:
                n += 1
            if n < len(toks):
                idx.truncate(n)
        if idx is None or len(idx.toks) > total:  # new, or its tokens were cut: start again
            idx = st.ngram = NgramIndex(self.n_min)
        have = len(idx.toks)
        if have < P:
            idx.extend(list(prompt[have:]))
            have = P
        if have < total:
            idx.extend(list(out[have - P:]))
        idx.confirmed = total
        return idx

    def propose(self, rows: list[Row], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens from rows[i]'s earlier tokens after its latest n-gram match."""
        out = []
        for row, k in zip(rows, ks):
            idx = self.index(row)
            if idx.ready is not None:
                p = idx.ready
                self.prepared_used += 1
            else:
                p = idx.match(self.n_max)
            idx.ready, idx.place = None, p
            out.append(idx.after(p, k))
        return out

    def prepare(self, rows: list[Row], proposals: list[list[int]]) -> None:
        """The pass of `rows` with these proposals is in flight: look up each proposing row's next match as if
        the pass keeps its proposal and then the token that followed the proposal where it was found (where
        the match ran to the sequence's end, the proposal's own first token: the repeat continues)."""
        for row, p in zip(rows, proposals):
            idx = row.spec.ngram if row.spec is not None else None
            if not p or idx is None or idx.confirmed != len(idx.toks) or idx.place < 0:
                continue
            toks, at = idx.toks, idx.place + 1
            if toks[at:at + len(p)] != p:
                continue  # not the proposal made from this place
            j = at + len(p)
            idx.extend(p + [toks[j] if j < len(toks) else p[j - len(toks)]])
            idx.ready = idx.match(self.n_max)
            self.prepared += 1

    def forget(self, everything: bool = False) -> None:
        """Nothing to drop: a row's index lives with the row."""

    def stats(self) -> dict:
        """Where the rows' suffixes are looked up; rows whose proposal was prepared while their pass was in flight,
        and how many of those were used."""
        return {"ngram_search": "host", "ngram_prepared": self.prepared, "ngram_prepared_used": self.prepared_used}
