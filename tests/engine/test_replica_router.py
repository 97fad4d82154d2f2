"""ReplicaRouter: prefix affinity (chats stick to their first turn's replica), the least
loaded replica otherwise, and no pile-up on a prefix every request shares."""

from __future__ import annotations

import pytest

from engine.core.replica_router import ReplicaRouter, RoutingPolicy

SYSTEM = ("system", "You are a helpful assistant. Answer briefly.")


class Cluster:
    """A router and each replica's open requests: `send` routes and opens one,
    `finish` closes one."""

    def __init__(self, num_replicas: int, policy: RoutingPolicy | None = None) -> None:
        self.router = ReplicaRouter(num_replicas, policy)
        self.loads = [0] * num_replicas

    def send(self, prompt) -> int:
        replica = self.router.route(prompt, self.loads)
        self.loads[replica] += 1
        return replica

    def finish(self, replica: int) -> None:
        self.loads[replica] -= 1


def turn(history: list[tuple[str, str]], k: int, chat: int) -> list[tuple[str, str]]:
    """Chat `chat`'s turn k: the earlier messages, the reply to the last, a new one."""
    if k == 0:
        return [*history, ("user", f"chat {chat} opens with its own question")]
    return [*history, ("assistant", f"reply {k} in chat {chat}"), ("user", f"follow-up {k}")]


def test_every_turn_of_a_chat_lands_on_the_replica_of_its_first_turn():
    cluster = Cluster(3)
    chats = {c: [SYSTEM] for c in range(6)}
    homes: dict[int, set[int]] = {c: set() for c in chats}
    for k in range(5):
        open_now = []
        for c in chats:  # all chats' turn k open together, then finish
            chats[c] = turn(chats[c], k, c)
            replica = cluster.send(chats[c])
            homes[c].add(replica)
            open_now.append(replica)
        for replica in open_now:
            cluster.finish(replica)
    assert all(len(h) == 1 for h in homes.values()), homes
    placed = [next(iter(h)) for h in homes.values()]
    assert sorted(placed.count(r) for r in range(3)) == [2, 2, 2]  # spread, then sticky


def test_a_shared_system_prompt_alone_does_not_attract_requests():
    cluster = Cluster(2)
    placed = [cluster.send([SYSTEM, ("user", f"question {i}")]) for i in range(10)]
    assert placed == [0, 1] * 5
    only_system = ReplicaRouter(2)
    assert only_system.prefixes([SYSTEM]).min_depth == 1
    assert only_system.prefixes([("user", "hi"), SYSTEM]).min_depth == 0


def test_a_sticky_chat_stays_although_its_replica_is_somewhat_busier():
    cluster = Cluster(2)
    first = [SYSTEM, ("user", "tell me a story")]
    home = cluster.send(first)
    cluster.finish(home)
    cluster.loads = [0, 0]
    cluster.loads[home] = 8  # exactly max_imbalance ahead: affinity holds
    assert cluster.send(turn(first, 1, 0)) == home


def test_the_load_guard_sends_a_match_to_the_least_loaded_when_its_replica_is_far_ahead():
    router = ReplicaRouter(2, RoutingPolicy(max_imbalance=2, max_imbalance_ratio=1.5))
    second_turn = router.prefixes(turn([SYSTEM, ("user", "tell me a story")], 1, 0))
    router.record(0, second_turn)
    assert router.choose(second_turn, [5, 2]) == 1  # 3 ahead (> 2) and 2.5x (> 1.5x)
    assert router.choose(second_turn, [12, 9]) == 0  # 3 ahead but only 1.33x
    assert router.choose(second_turn, [4, 2]) == 0  # 2x but only 2 ahead


def test_a_shared_text_prefix_never_piles_more_than_the_guard_allows():
    """Few-shot prompts (a 600-character shared text, then each its own question), all
    open at once: the replica that saw the prefix first gets at most max_imbalance
    ahead, then the others learn it and load decides."""
    policy = RoutingPolicy(max_imbalance=4)
    cluster = Cluster(3, policy)
    shared = "Q: example question? A: example answer. " * 15
    for i in range(90):
        cluster.send(shared + f"Q: question number {i}? A:" + " pad" * 70)
        assert max(cluster.loads) - min(cluster.loads) <= policy.max_imbalance + 1
    assert max(cluster.loads) - min(cluster.loads) <= 1
    assert all(
        cluster.router.match_depth(r, cluster.router.prefixes(shared).hashes) == 2 for r in range(3)
    )


def test_a_text_that_extends_an_earlier_one_follows_it():
    cluster = Cluster(2)
    story = "Once upon a time " * 20  # 340 characters: one full chunk
    home = cluster.send(story)
    cluster.finish(home)
    cluster.send("an unrelated prompt")  # the other replica now has sent one too
    assert cluster.send(story + " and then the dragon slept.") == home


def test_a_prefix_shorter_than_one_chunk_matches_nothing():
    router = ReplicaRouter(2, RoutingPolicy(text_chunk_chars=8, ids_chunk=4))
    assert router.prefixes("1234567").hashes == ()
    assert len(router.prefixes("12345678").hashes) == 1
    assert router.prefixes([1, 2, 3]).hashes == ()
    assert len(router.prefixes([1, 2, 3, 4, 5, 6, 7, 8, 9]).hashes) == 2


def test_token_id_prompts_follow_their_longest_recorded_prefix():
    cluster = Cluster(3)
    a, b = list(range(32)), list(range(100, 116))
    home_a, home_b = cluster.send(a), cluster.send(b)
    assert home_a != home_b
    cluster.loads = [1, 1, 1]
    assert cluster.send(a + [7] * 20) == home_a
    assert cluster.send(b + [9] * 3) == home_b
    assert cluster.send(a[:16] + b) == home_a  # a's first chunk only: still a's


def test_equal_matches_go_to_the_least_loaded_of_them():
    router = ReplicaRouter(3)
    prefixes = router.prefixes(list(range(48)))
    router.record(0, prefixes)
    router.record(2, prefixes)
    assert router.choose(prefixes, [5, 0, 3]) == 2  # 1 is idle but holds nothing
    deeper = router.prefixes(list(range(64)))
    router.record(0, deeper)
    assert router.choose(deeper, [5, 0, 3]) == 0


def test_independent_requests_alternate_whether_they_overlap_or_not():
    sequential = Cluster(2)
    placed = []
    for i in range(8):
        placed.append(sequential.send(f"independent prompt {i}"))
        sequential.finish(placed[-1])
    assert placed == [0, 1] * 4
    concurrent = Cluster(4)
    for i in range(40):
        concurrent.send([("user", f"question {i}")])
    assert concurrent.loads == [10, 10, 10, 10]


def test_each_kind_of_prompt_hashes_apart():
    router = ReplicaRouter(1, RoutingPolicy(text_chunk_chars=2, ids_chunk=2))
    text, ids, chat = "ab", [97, 98], [("user", "ab")]
    hashes = [router.prefixes(p).hashes for p in (text, ids, chat)]
    assert len({h for hs in hashes for h in hs}) == 3


def test_each_replica_remembers_a_bounded_number_of_prefixes_least_recent_first():
    router = ReplicaRouter(1, RoutingPolicy(ids_chunk=1, max_hashes_per_replica=4))
    old, new = router.prefixes([1, 2, 3]), router.prefixes([7, 8])
    router.record(0, old)
    router.record(0, new)
    remembered = [router.match_depth(0, (h,)) for h in old.hashes + new.hashes]
    assert remembered == [0, 1, 1, 1, 1]  # 4 of the 5, the least recent forgotten
    assert router.match_depth(0, old.hashes) == 0  # its first hash was forgotten
    assert router.match_depth(0, new.hashes) == 2
    router.record(0, router.prefixes([1]))  # refreshed: now the most recent
    router.record(0, router.prefixes([9, 10, 11]))
    assert router.match_depth(0, router.prefixes([1]).hashes) == 1


def test_bad_settings_and_loads_are_refused_by_name():
    with pytest.raises(ValueError, match="num_replicas"):
        ReplicaRouter(0)
    with pytest.raises(ValueError, match="ids_chunk"):
        RoutingPolicy(ids_chunk=0)
    with pytest.raises(ValueError, match="max_imbalance_ratio"):
        RoutingPolicy(max_imbalance_ratio=0.5)
    with pytest.raises(ValueError, match="3 loads given for 2 replicas"):
        ReplicaRouter(2).route("hi", [0, 0, 0])
