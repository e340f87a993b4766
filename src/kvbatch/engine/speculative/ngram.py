"""N-gram proposals (vLLM's `ngram` method, "prompt lookup decoding"): the row's last n tokens are
looked up in its own earlier tokens (prompt and output), n from prompt_lookup_max down to
prompt_lookup_min; the tokens that followed the latest earlier occurrence are proposed."""
from __future__ import annotations

import numpy as np

from kvbatch.engine.row import Row


def ngram_propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens`
    (n_max down to n_min tokens) that occurred before; [] when none did."""
    L = len(tokens)
    if L < n_min + 1 or k <= 0:
        return []
    # candidate ends: earlier positions p (p < L - 1) holding the last token; then checked backwards
    last = tokens[-1]
    ends = np.flatnonzero(tokens[:L - 1] == last)
    if ends.size == 0:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        ok = ends[ends >= n - 1]
        for back in range(1, n):
            if ok.size == 0:
                break
            ok = ok[tokens[ok - back] == tokens[L - 1 - back]]
        if ok.size:
            start = int(ok[-1]) + 1
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    """Proposals from each row's own tokens: an int32 copy of its sequence kept with the row
    (RowSpec.buf) and extended by its new tokens, not rebuilt each step."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    @staticmethod
    def tokens(row: Row) -> np.ndarray:
        """The row's prompt and output as int32 (its RowSpec's copy brought up to date)."""
        st = row.spec
        assert st is not None, "a speculating row has its RowSpec"
        seq, out = row.req.prompt_tokens, row.out
        n = len(seq) + len(out)
        if st.buf is None or n > st.buf.size:
            buf = np.empty(max(2 * n, 64), dtype=np.int32)
            if st.buf is not None:
                buf[:st.have] = st.buf[:st.have]
            st.buf = buf
        have = st.have
        if have < len(seq):
            st.buf[have:len(seq)] = seq[have:]
            have = len(seq)
        if have < n:
            st.buf[have:n] = out[have - len(seq):]
        st.have = n
        return st.buf[:n]

    def propose(self, rows: list[Row], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens from rows[i]'s earlier tokens after its latest n-gram match."""
        return [ngram_propose(self.tokens(row), k, self.n_min, self.n_max) for row, k in zip(rows, ks)]

    def forget(self, everything: bool = False) -> None:
        """Nothing to drop: a row's tokens live with the row."""

    def stats(self) -> dict:
        """No figures of its own."""
        return {}
