"""Prompt-lookup proposals: when the last n tokens of a request occurred earlier in it (the prompt
or its own output), propose the tokens that followed that occurrence.

Summaries and reviews copy phrases from the paper in their prompt, so a suffix of the output often
matches the prompt and the continuation is right for several tokens. The longest n in
[min_n, max_n] that matches wins (a longer match predicts better); among its occurrences, the most
recent one (the nearest context is the likeliest to continue the same way).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.request import Request


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: list[tuple[Request, int]]) -> None:
        """Set spec_token_ids of each (request, k) to at most k proposed tokens."""
        for request, k in requests:
            request.spec_token_ids = propose_ngram(request.all_token_ids, self.min_n, self.max_n, k)

    def forget(self, request_id: str) -> None:
        """Nothing to drop: proposals are computed from the request's tokens alone."""


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    token_ids with length in [min_n, max_n]; [] when no suffix of min_n tokens recurs."""
    num = len(token_ids)
    if k < 1 or num <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = tokens[num - n :]
        # Windows that start before the suffix itself: the match must have a next token that is
        # already known, so the window may end at position num - 2 at the latest.
        windows = sliding_window_view(tokens[: num - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return token_ids[start : start + k]
    return []
