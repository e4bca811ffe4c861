"""The routing policies on their own, no HTTP: prompts that share their first blocks go to one
replica, new prompts spread, a busy holder gives way to an idle replica, and a replica that
leaves takes only its own prefixes with it."""

from __future__ import annotations

import pytest

from engine.router.policy import (
    BY_LOAD,
    BY_PREFIX,
    LeastOutstandingPolicy,
    PrefixAffinityPolicy,
    RoundRobinPolicy,
    make_policy,
)
from engine.router.prefix_index import PrefixIndex
from engine.router.prefix_key import block_hashes, body_block_hashes, routing_text
from engine.router.replica import Replica

SYSTEM = "You are a careful reviewer of research papers. " * 6  # ~290 characters, shared


def _paper(i: int) -> str:
    return f"Title: paper {i}\n" + f"Paper {i} studies topic {i * 7919 % 1000}. " * 25


def _chat(i: int, task: str) -> dict:
    return {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{_paper(i)}\n\nTask: {task}"},
        ]
    }


def _blocks(body: dict) -> list[bytes]:
    return block_hashes(routing_text(body))


def _replicas(n: int) -> list[Replica]:
    return [Replica(f"http://10.0.0.{i}:8000", healthy=True) for i in range(n)]


def test_routing_text_of_each_request_shape():
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "U"}]}]}
    assert routing_text(chat).endswith("user\x1fU") and "S" in routing_text(chat)
    assert routing_text(parts) == "\x1euser\x1fU"
    assert routing_text({"prompt": "abc"}) == "abc"
    assert routing_text({"prompt": ["abc", "def"]}) == "abc"  # a batch: by its first prompt
    assert routing_text({"prompt": [1, 2, 3]}) == "1 2 3"
    assert routing_text({"prompt": [[1, 2], [3]]}) == "1 2"
    assert routing_text({"input": "embed me"}) == "embed me"
    for nothing in ({}, [], "x", {"messages": "no"}, {"prompt": 5}, {"messages": [5, None]}):
        assert routing_text(nothing) == ""


def test_message_boundaries_are_part_of_the_text():
    a = {"messages": [{"role": "user", "content": "ab"}, {"role": "user", "content": "c"}]}
    b = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "bc"}]}
    assert routing_text(a) != routing_text(b)


def test_block_hashes_are_chained_and_cover_only_full_blocks():
    a = block_hashes("x" * 64 + "y" * 64 + "z" * 10, 64)
    b = block_hashes("x" * 64 + "w" * 64, 64)
    assert len(a) == 2 and len(b) == 2
    assert a[0] == b[0] and a[1] != b[1]
    # The same block after a different parent hashes differently.
    assert block_hashes("q" * 64 + "y" * 64, 64)[1] != a[1]
    assert block_hashes("short", 64) == []
    assert len(block_hashes("x" * 10_000, 64, max_blocks=5)) == 5
    with pytest.raises(ValueError):
        block_hashes("abc", 0)


def test_body_block_hashes_of_a_body_that_is_not_json():
    assert body_block_hashes(b"{not json") == []
    assert body_block_hashes(b"") == []
    assert body_block_hashes(b"[" * 100_000) == []  # too deep to parse: no key, no crash
    assert body_block_hashes(b'{"prompt": "' + b"a" * 200 + b'"}', 64) == block_hashes("a" * 200)


def test_prefix_index_matches_leading_blocks_and_evicts_tails_first():
    index = PrefixIndex(capacity_blocks=4)
    index.insert("r", [b"a", b"b", b"c"])
    assert index.match("r", [b"a", b"b", b"x"]) == 2
    assert index.match("r", [b"x", b"b"]) == 0
    assert index.match("other", [b"a"]) == 0
    index.insert("r", [b"d", b"e"])  # over capacity: the oldest tail goes first
    assert index.size("r") == 4
    assert index.match("r", [b"a", b"b"]) == 2 and index.match("r", [b"a", b"b", b"c"]) == 2
    index.forget("r")
    assert index.size("r") == 0


def test_a_papers_review_follows_its_summary_and_new_papers_spread():
    policy, replicas = PrefixAffinityPolicy(), _replicas(2)
    where = {}
    for i in range(8):
        summary = policy.choose(_blocks(_chat(i, "summarize")), replicas)
        review = policy.choose(_blocks(_chat(i, "review it as JSON")), replicas)
        assert summary.reason == BY_LOAD  # only the system text is held anywhere
        assert review.reason == BY_PREFIX and review.replica is summary.replica
        where[i] = summary.replica.url
    # The new papers alternate: the one with the smaller cache takes the next.
    assert sorted(where.values()).count(replicas[0].url) == 4


def test_the_load_guard_sends_a_hot_prefix_elsewhere():
    policy, (a, b) = PrefixAffinityPolicy(balance_abs=2), _replicas(2)
    first = policy.choose(_blocks(_chat(0, "summarize")), [a, b]).replica
    other = b if first is a else a
    first.outstanding = 2
    assert policy.choose(_blocks(_chat(0, "again")), [a, b]).replica is first  # within the guard
    first.outstanding = 3
    choice = policy.choose(_blocks(_chat(0, "again")), [a, b])
    assert choice.replica is other and choice.reason == BY_LOAD


def test_a_short_match_is_not_affinity():
    policy, replicas = PrefixAffinityPolicy(min_match=0.9), _replicas(2)
    first = policy.choose(_blocks(_chat(0, "summarize")), replicas).replica
    # The same paper with a long different task: under 90% shared.
    choice = policy.choose(_blocks(_chat(0, "x" * 2000)), replicas)
    assert choice.reason == BY_LOAD and choice.replica is not first


def test_a_replica_that_leaves_takes_only_its_own_prefixes():
    policy, replicas = PrefixAffinityPolicy(), _replicas(3)
    home = {i: policy.choose(_blocks(_chat(i, "summarize")), replicas).replica for i in range(9)}
    gone = replicas[1]
    policy.forget(gone.url)
    left = [r for r in replicas if r is not gone]
    for i, replica in home.items():
        choice = policy.choose(_blocks(_chat(i, "review")), left)
        if replica is gone:
            assert choice.reason == BY_LOAD
        else:  # unmoved: the prefixes on the replicas that stayed keep their replica
            assert choice.replica is replica and choice.reason == BY_PREFIX


def test_least_outstanding_and_round_robin():
    a, b, c = _replicas(3)
    a.outstanding, b.outstanding, c.outstanding = 3, 1, 2
    assert LeastOutstandingPolicy().choose([], [a, b, c]).replica is b
    rr = RoundRobinPolicy()
    assert [rr.choose([], [c, a, b]).replica for _ in range(4)] == [a, b, c, a]


def test_make_policy_refuses_unknown_names_and_bad_options():
    assert isinstance(make_policy("prefix"), PrefixAffinityPolicy)
    with pytest.raises(ValueError, match="--policy"):
        make_policy("random")
    with pytest.raises(ValueError):
        PrefixAffinityPolicy(min_match=0)
    with pytest.raises(ValueError):
        PrefixAffinityPolicy(balance_abs=-1)
