"""Draft-tree construction and greedy acceptance (runtime/spec_tree.py) against hand-worked
examples and a brute-force host walk over random trees."""
import random

import pytest
import torch

from attn_backends import SpecInfo
from attn_backends_runtime.spec_tree import _tree, build_tree, first_level, greedy_accept

I64 = torch.int64


def t(x, dtype=I64):
    return torch.tensor(x, dtype=dtype)


def test_chain_is_causal_and_accepts_the_matching_prefix():
    tree = build_tree(t([5]), t([[7]]), t([[-0.1]], torch.float32), t([[[8], [9]]]), t([[[-0.2], [-0.3]]],
                      torch.float32), num_draft_tokens=4)
    assert tree.tokens.tolist() == [[5, 7, 8, 9]]
    assert tree.levels.tolist() == [[0, 1, 2, 3]]
    assert torch.equal(tree.mask[0], torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    # the target agrees with 7 and 8, not with 9: accept root + 2 drafts, bonus = target after 8
    acc = greedy_accept(tree, t([[7, 8, 42, 0]]))
    assert acc.accept_lens.tolist() == [3]
    assert acc.emitted[0, :3].tolist() == [7, 8, 42]
    assert acc.path[0, :3].tolist() == [0, 1, 2]
    # nothing matches: only the bonus (accept_len 1); everything matches: N tokens
    assert greedy_accept(tree, t([[1, 1, 1, 1]])).accept_lens.tolist() == [1]
    full = greedy_accept(tree, t([[7, 8, 9, 3]]))
    assert full.accept_lens.tolist() == [4] and full.emitted[0].tolist() == [7, 8, 9, 3]


def test_tree_reranks_by_cumulative_logprob():
    # level 1: 10 (-0.1), 20 (-0.5); level 2: 11 after 10 (cum -0.3), 21 after 20 (cum -0.55)
    tree = build_tree(t([1]), t([[10, 20]]), t([[-0.1, -0.5]], torch.float32), t([[[11, 21]]]),
                      t([[[-0.2, -0.05]]], torch.float32), num_draft_tokens=4)
    assert tree.tokens.tolist() == [[1, 10, 20, 11]]           # 21 (cum -0.55) is cut
    assert tree.levels.tolist() == [[0, 1, 1, 2]]
    want = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(tree.mask[0], want)
    acc = greedy_accept(tree, t([[20, 0, 99, 0]]))               # the target prefers branch 2
    assert acc.accept_lens.tolist() == [2] and acc.emitted[0, :2].tolist() == [20, 99]
    assert acc.path[0, :2].tolist() == [0, 2]
    acc = greedy_accept(tree, t([[10, 11, 0, 77]]))              # down branch 1 to its end
    assert acc.accept_lens.tolist() == [3] and acc.emitted[0, :3].tolist() == [10, 11, 77]
    assert acc.path[0, :3].tolist() == [0, 1, 3]


def test_ties_keep_parents_before_children():
    # probability-1 tokens: every score is 0, the deeper nodes must not displace their parents
    z = torch.zeros(1, 3)
    tree = build_tree(t([0]), t([[1, 2, 3]]), z, t([[[4, 5, 6], [7, 8, 9]]]), torch.zeros(1, 2, 3), 5)
    assert tree.tokens.tolist() == [[0, 1, 2, 3, 4]]
    assert tree.levels.tolist() == [[0, 1, 1, 1, 2]]


def test_num_draft_tokens_bounds():
    with pytest.raises(ValueError, match=r"num_draft_tokens=4 outside 2..num_steps\*topk\+1=3"):
        build_tree(t([0]), t([[1, 2]]), torch.zeros(1, 2), None, None, 4)
    with pytest.raises(ValueError, match="topk=9 exceeds the vocabulary size 8"):
        first_level(torch.zeros(2, 8), 9)


def walk(tokens, levels, branch, target):
    """Host reference: the greedy walk from the root over explicit parent links."""
    n = len(tokens)
    parent = [-1] + [next((r for r in range(n) if levels[r] == levels[i] - 1 and (levels[r] == 0 or branch[r]
                                                                                  == branch[i])), None)
                     for i in range(1, n)]
    cur, path = 0, [0]
    while True:
        nxt = [c for c in range(1, n) if parent[c] == cur and tokens[c] == target[cur]]
        if not nxt:
            break
        cur = nxt[0]
        path.append(cur)
    return path, [target[r] for r in path]


@pytest.mark.parametrize("topk,steps", [(1, 4), (2, 3), (3, 2), (4, 4)])
def test_random_trees_match_the_host_walk(topk, steps):
    rng = random.Random(topk * 10 + steps)
    g = torch.Generator().manual_seed(topk + steps)
    for _ in range(30):
        bs, vocab = 3, 6
        n = rng.randint(2, steps * topk + 1 if topk > 1 else steps + 1)
        spec = SpecInfo(n, topk, steps)                          # the bounds the runners enforce
        first = torch.stack([torch.randperm(vocab, generator=g)[:topk] for _ in range(bs)])
        lp0 = -torch.rand(bs, topk, generator=g)
        br = torch.randint(0, vocab, (bs, steps - 1, topk), generator=g) if steps > 1 else None
        lpb = -torch.rand(bs, steps - 1, topk, generator=g) if steps > 1 else None
        tree = build_tree(torch.randint(0, vocab, (bs,), generator=g), first, lp0, br, lpb, spec.num_draft_tokens)
        # parents chosen, rows level-major, mask = ancestors
        for b in range(bs):
            lv, brn = tree.levels[b].tolist(), tree.branch[b].tolist()
            assert lv == sorted(lv) and lv[0] == 0
            for r in range(1, n):
                assert lv[r] == 1 or any(lv[p] == lv[r] - 1 and brn[p] == brn[r] for p in range(n))
        target = torch.randint(0, vocab, (bs, n), generator=g)
        target[:, 0] = first[:, 0]                            # often at least one accepted token
        acc = greedy_accept(tree, target)
        for b in range(bs):
            path, emitted = walk(tree.tokens[b].tolist(), tree.levels[b].tolist(), tree.branch[b].tolist(),
                                 target[b].tolist())
            a = int(acc.accept_lens[b])
            assert 1 <= a <= n
            assert acc.path[b, :a].tolist() == path and acc.emitted[b, :a].tolist() == emitted


@pytest.mark.parametrize("steps", [1, 2, 4, 7])
def test_the_chain_fast_path_equals_the_general_tree(steps):
    """topk 1 builds the chain in one launch and accepts it in five; the general rerank and walk
    must give the same tree, accept lengths, path and emitted tokens (long accepts included)."""
    g = torch.Generator().manual_seed(steps)
    for n in range(2, steps + 2):
        bs, vocab = 5, 4
        first, lp0 = torch.randint(0, vocab, (bs, 1), generator=g), -torch.rand(bs, 1, generator=g)
        br = torch.randint(0, vocab, (bs, steps - 1, 1), generator=g) if steps > 1 else None
        lpb = -torch.rand(bs, steps - 1, 1, generator=g) if steps > 1 else None
        root = torch.randint(0, vocab, (bs,), generator=g)
        fast, slow = build_tree(root, first, lp0, br, lpb, n), _tree(root, first, lp0, br, lpb, n)
        assert fast.chain and not slow.chain
        for name in ("tokens", "levels", "branch", "mask"):
            assert torch.equal(getattr(fast, name), getattr(slow, name)), name
        for _ in range(20):
            target = torch.randint(0, vocab, (bs, n), generator=g)
            agree = torch.rand(bs, n - 1, generator=g) < 0.8              # mostly accepted: lengths up to N
            target[:, :-1] = torch.where(agree, fast.tokens[:, 1:], target[:, :-1])
            a, b = greedy_accept(fast, target), greedy_accept(slow, target)
            assert a.accept_lens.dtype == torch.int32
            assert a.accept_lens.tolist() == b.accept_lens.tolist()
            for i, m in enumerate(a.accept_lens.tolist()):
                assert a.path[i, :m].tolist() == b.path[i, :m].tolist()
                assert a.emitted[i, :m].tolist() == b.emitted[i, :m].tolist()
