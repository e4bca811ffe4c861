"""Verification of proposed tokens against the target model's distribution.

A request with drafts d1..dk gets k + 1 rows of target logits: row j is the prediction after its
last token and d1..dj. Each row is processed exactly as the plain sampler would process it at that
point of the output (penalties and min_tokens see d1..dj as already generated), so:

- greedy rows accept d(j+1) while it is the row's argmax; the first mismatch emits the argmax
  instead, and when every draft matches, the last row's argmax is a bonus token. The output is
  token for token what non-speculative greedy decoding gives.
- random rows use rejection sampling (Leviathan et al. 2023; Chen et al. 2023). Our proposals are
  deterministic (an n-gram lookup, a draft model's argmax), i.e. a point mass q at d, so: accept d
  with probability min(1, p(d) / q(d)) = p(d); on rejection draw from the residual
  max(p - q, 0) / Z, which is p with d removed and renormalized; after k acceptances draw the bonus
  from the last row's p. Each emitted token is then distributed exactly as p at its position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprobs
from engine.sampler import (
    SamplingRow,
    draw,
    is_greedy,
    logprobs_dicts,
    process_logits,
    random_probs,
    raw_logprobs_of,
    uniforms,
)
from engine.structured.bitmask import GrammarMask


@dataclass(slots=True)
class VerifyOutput:
    token_ids: list[list[int]]  # per request: its accepted drafts, then one more token
    logprobs: list[list[TokenLogprobs | None]]  # per request, per emitted token
    num_accepted: list[int]  # per request: drafts accepted


class RejectionSampler:
    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        drafts: list[list[int]],
        grammar: GrammarMask | None = None,
    ) -> VerifyOutput:
        """logits [R, vocab] (modified in place) with rows[r] describing row r; request i owns
        len(drafts[i]) + 1 consecutive rows, in order."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if len(rows) != sum(len(d) + 1 for d in drafts):
            raise ValueError(f"{len(rows)} rows do not match drafts of {len(drafts)} requests")
        raw = raw_logprobs_of(logits, rows)
        process_logits(logits, rows, grammar)
        greedy = [is_greedy(row) for row in rows]
        argmax = logits.argmax(dim=-1).tolist() if any(greedy) else []
        rand = [r for r, g in enumerate(greedy) if not g]
        probs = random_probs(logits[rand], [rows[r] for r in rand]) if rand else None
        prob_row = {r: i for i, r in enumerate(rand)}
        # p(d) and a uniform for every random row that has a draft to judge.
        judged = _judged_rows(drafts, greedy)
        if judged:
            index = torch.tensor([prob_row[r] for r, _ in judged], device=logits.device)
            token = torch.tensor([d for _, d in judged], device=logits.device)
            p_draft = probs[index, token].tolist()
            u = uniforms([rows[r].generator for r, _ in judged], logits.device).tolist()
            accept_random = {r: u_r < p_r for (r, _), u_r, p_r in zip(judged, u, p_draft)}
        else:
            accept_random = {}

        token_ids: list[list[int]] = []
        num_accepted: list[int] = []
        row_tokens = [0] * len(rows)  # the emitted token of each row reached (for logprobs)
        first = 0
        for draft in drafts:
            out: list[int] = []
            for j, d in enumerate(draft):
                r = first + j
                if greedy[r]:
                    accepted, fallback = argmax[r] == d, argmax[r]
                else:
                    accepted = accept_random[r]
                    fallback = None if accepted else _draw_residual(probs[prob_row[r]], d, rows[r])
                out.append(d if accepted else fallback)
                row_tokens[r] = out[-1]
                if not accepted:
                    break
            else:
                r = first + len(draft)
                bonus = argmax[r] if greedy[r] else _draw_row(probs[prob_row[r]], rows[r])
                out.append(bonus)
                row_tokens[r] = bonus
            token_ids.append(out)
            num_accepted.append(len(out) - 1)
            first += len(draft) + 1

        entries = logprobs_dicts(raw, row_tokens, rows)
        logprobs, first = [], 0
        for draft, out in zip(drafts, token_ids):
            logprobs.append(entries[first : first + len(out)])
            first += len(draft) + 1
        return VerifyOutput(token_ids, logprobs, num_accepted)


def _judged_rows(drafts: list[list[int]], greedy: list[bool]) -> list[tuple[int, int]]:
    """(row, draft token) for every random row that judges a draft."""
    judged, first = [], 0
    for draft in drafts:
        judged += [(first + j, d) for j, d in enumerate(draft) if not greedy[first + j]]
        first += len(draft) + 1
    return judged


def _draw_residual(p: torch.Tensor, draft: int, row: SamplingRow) -> int:
    """A draw from max(p - q, 0) with q the point mass at `draft`: p without the draft token
    (draw() renormalizes by the row's own total)."""
    residual = p.clone()
    residual[draft] = 0.0
    return _draw_row(residual, row)


def _draw_row(p: torch.Tensor, row: SamplingRow) -> int:
    return int(draw(p.unsqueeze(0), [row.generator])[0])
