"""The n-gram drafter (prompt lookup): no draft model, only the request's own tokens.

For each request, find the longest suffix n-gram (n from `prompt_lookup_max` down to
`prompt_lookup_min`) that also occurs earlier in its tokens (prompt and output), and
propose the k tokens that followed its earliest occurrence, as vLLM's NgramProposer does.
Copying, editing and quoting make text repeat itself, and there the drafts are right.

One pass over the whole batch at once: the rows are matched against their suffixes with
`prompt_lookup_max` vectorised comparisons, not a Python loop per token."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Proposes up to `k` drafts per request by prompt lookup."""

    def __init__(self, k: int, lookup_min: int, lookup_max: int, max_model_len: int) -> None:
        self.k = k
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max
        self.max_model_len = max_model_len

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> list[list[int]]:
        """Drafts per row of `token_ids` [R, L] whose first `num_tokens[r]` are known."""
        num_tokens = np.asarray(num_tokens, dtype=np.int64)
        rows = len(num_tokens)
        if rows == 0:
            return []
        width = int(num_tokens.max())
        tokens = np.asarray(token_ids)[:, :width]
        # run[r, e]: how many tokens ending at e match the suffix of row r, backwards,
        # up to lookup_max. A candidate end e must leave the suffix itself out: e <= L - 2.
        ends = np.arange(width)
        alive = ends[None, :] <= (num_tokens - 2)[:, None]
        run = np.zeros((rows, width), dtype=np.int64)
        last = num_tokens - 1
        for t in range(self.lookup_max):
            src = ends - t
            suffix_at = last - t
            ok = (src >= 0)[None, :] & (suffix_at >= 0)[:, None]
            left = tokens[:, np.maximum(src, 0)]
            right = tokens[np.arange(rows), np.maximum(suffix_at, 0)][:, None]
            alive &= ok & (left == right)
            if not alive.any():
                break
            run += alive
        longest = run.max(axis=1)
        # The earliest occurrence of the longest match, as vLLM picks it.
        end = np.argmax(run == longest[:, None], axis=1)
        out: list[list[int]] = []
        for r in range(rows):
            n = int(num_tokens[r])
            k = min(self.k, self.max_model_len - n)
            if longest[r] < self.lookup_min or k <= 0:
                out.append([])
                continue
            start = int(end[r]) + 1
            out.append(tokens[r, start : min(start + k, n)].tolist())
        return out


def propose_lists(proposer: NgramProposer, rows: Sequence[Sequence[int]]) -> list[list[int]]:
    """`proposer.propose` for token lists of different lengths."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    batch = np.zeros((len(rows), int(lengths.max()) if len(rows) else 0), dtype=np.int64)
    for r, tokens in enumerate(rows):
        batch[r, : len(tokens)] = tokens
    return proposer.propose(batch, lengths)


def propose_one(tokens: Sequence[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """The same proposal for one request, by its definition (the tests' reference)."""
    n_tok = len(tokens)
    for n in range(min(lookup_max, n_tok - 1), lookup_min - 1, -1):
        suffix = list(tokens[n_tok - n :])
        for i in range(n_tok - n):
            if list(tokens[i : i + n]) == suffix:
                return list(tokens[i + n : i + n + k])
    return []
