"""Which replica gets a request. Three policies, one interface (`choose`):

- `prefix` (the default): the replica believed to hold the longest prefix of the prompt
  (PrefixIndex), when that prefix is at least `min_match` of the prompt and the replica is not
  more than `balance_abs` requests busier than the least busy one; otherwise the least busy one
  (least outstanding requests, then the smaller cache, then the URL, so that a quiet router
  still spreads new prompts). A paper's summary and review share their system text and the
  paper and differ only in the task: the review follows the summary to its replica. A prompt
  that shares only the system text (a new paper) goes where there is room. This is SGLang's
  cache-aware router (match threshold, then shortest queue) with llm-d's block-hash scorer.
- `least-outstanding`: the least busy replica.
- `round-robin`: each in turn, whatever they hold (the baseline affinity is measured against).

Consistency: a replica that leaves takes only its own prefixes with it (`forget`); the prompts
believed held elsewhere keep their replica."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from engine.router.prefix_index import DEFAULT_CAPACITY_BLOCKS, PrefixIndex
from engine.router.replica import Replica

PolicyName = Literal["prefix", "least-outstanding", "round-robin"]
POLICIES: tuple[str, ...] = ("prefix", "least-outstanding", "round-robin")

# Why a replica was chosen (the router counts each): a prefix it holds, or the load.
BY_PREFIX, BY_LOAD, BY_TURN = "prefix", "load", "turn"


@dataclass(slots=True, frozen=True)
class Choice:
    replica: Replica
    reason: str  # BY_PREFIX, BY_LOAD or BY_TURN
    matched_blocks: int = 0


class RoutingPolicy(Protocol):
    def choose(self, blocks: list[bytes], candidates: Sequence[Replica]) -> Choice:
        """One of `candidates` (never empty) for a prompt with these block hashes."""
        ...

    def forget(self, url: str) -> None:
        """The replica left, or came back with an empty cache."""
        ...


def _least_busy(candidates: Sequence[Replica], index: PrefixIndex | None = None) -> Replica:
    def load(r: Replica) -> tuple:
        return (r.outstanding, index.size(r.url) if index else 0, r.url)

    return min(candidates, key=load)


class LeastOutstandingPolicy:
    def choose(self, blocks: list[bytes], candidates: Sequence[Replica]) -> Choice:
        return Choice(_least_busy(candidates), BY_LOAD)

    def forget(self, url: str) -> None:
        pass


class RoundRobinPolicy:
    def __init__(self) -> None:
        self._turn = 0

    def choose(self, blocks: list[bytes], candidates: Sequence[Replica]) -> Choice:
        ordered = sorted(candidates, key=lambda r: r.url)
        self._turn += 1
        return Choice(ordered[(self._turn - 1) % len(ordered)], BY_TURN)

    def forget(self, url: str) -> None:
        pass


class PrefixAffinityPolicy:
    def __init__(
        self,
        min_match: float = 0.5,
        balance_abs: int = 8,
        capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
    ) -> None:
        """min_match: the share of a prompt's blocks a replica must hold to be chosen for it
        (SGLang's cache_threshold, 0.5). balance_abs: how many requests more than the least
        busy replica the holder may have in flight and still be chosen: the load guard that
        keeps one hot prefix from piling every request onto one replica."""
        if not 0 < min_match <= 1:
            raise ValueError(f"min_match must be in (0, 1], got {min_match}")
        if balance_abs < 0:
            raise ValueError(f"balance_abs must be >= 0, got {balance_abs}")
        self.min_match, self.balance_abs = min_match, balance_abs
        self.index = PrefixIndex(capacity_blocks)

    def choose(self, blocks: list[bytes], candidates: Sequence[Replica]) -> Choice:
        choice = self._pick(blocks, candidates)
        self.index.insert(choice.replica.url, blocks)
        return choice

    def _pick(self, blocks: list[bytes], candidates: Sequence[Replica]) -> Choice:
        least = _least_busy(candidates, self.index)
        if not blocks:
            return Choice(least, BY_LOAD)
        matched = {r.url: self.index.match(r.url, blocks) for r in candidates}
        best = max(candidates, key=lambda r: (matched[r.url], -r.outstanding, r.url))
        held = matched[best.url]
        if held >= self.min_match * len(blocks) and (
            best.outstanding <= least.outstanding + self.balance_abs
        ):
            return Choice(best, BY_PREFIX, held)
        return Choice(least, BY_LOAD, matched[least.url])

    def forget(self, url: str) -> None:
        self.index.forget(url)


def make_policy(name: str, **options: float) -> RoutingPolicy:
    if name == "prefix":
        return PrefixAffinityPolicy(**options)  # type: ignore[arg-type]
    if name == "least-outstanding":
        return LeastOutstandingPolicy()
    if name == "round-robin":
        return RoundRobinPolicy()
    raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, not {name!r}")
