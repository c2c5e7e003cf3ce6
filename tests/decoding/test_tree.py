import pytest
import torch

from decoding import DraftTree, TreeTemplate
from decoding.generate import prune_to_depth


def test_chain_structure():
    tree = DraftTree.chain([5, 6, 7])
    assert tree.parents.tolist() == [-1, 0, 1]
    assert tree.depth.tolist() == [1, 2, 3]
    assert tree.paths == [[0, 1, 2]]
    assert tree.ancestor_mask.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, False],
        [True, True, True, True],
    ]


def test_branching_tree_derivations():
    #        root
    #       /    \
    #      0      1
    #     / \     |
    #    2   3    4
    tree = DraftTree(torch.tensor([10, 11, 12, 13, 14]), torch.tensor([-1, -1, 0, 0, 1]))
    assert tree.depth.tolist() == [1, 1, 2, 2, 2]
    assert tree.children == [[0, 1], [2, 3], [4], [], [], []]
    assert sorted(tree.paths) == [[0, 2], [0, 3], [1, 4]]
    assert tree.token_paths == [(10,), (11,), (10, 12), (10, 13), (11, 14)]
    mask = tree.ancestor_mask
    assert mask[3].tolist() == [True, True, False, True, False, False]  # node 2 sees root, node 0, itself
    assert mask[5].tolist() == [True, False, True, False, False, True]  # node 4 sees root, node 1, itself
    assert not mask[2, 1]  # siblings never see each other


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 2, 0], [-2]])
def test_invalid_parents_rejected(parents):
    with pytest.raises(ValueError, match="parent"):
        DraftTree(torch.zeros(len(parents), dtype=torch.long), torch.tensor(parents))


def test_shape_mismatch_rejected():
    with pytest.raises(ValueError, match="tokens but"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1]))


def test_template_from_choices():
    template = TreeTemplate([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert len(template) == 6
    candidates = torch.tensor([[10, 11], [20, 21], [30, 31]])  # [depth, rank]
    tree = template.fill(candidates)
    by_choice = dict(zip(map(tuple, template.choices), tree.tokens.tolist()))
    assert by_choice == {(0,): 10, (1,): 11, (0, 0): 20, (0, 1): 21, (1, 0): 20, (0, 0, 0): 30}
    parents = dict(zip(map(tuple, template.choices), tree.parents.tolist()))
    index = {tuple(c): i for i, c in enumerate(template.choices)}
    assert parents[(0, 0, 0)] == index[(0, 0)] and parents[(1, 0)] == index[(1,)] and parents[(0,)] == -1


def test_template_rejects_missing_prefix_and_small_candidates():
    with pytest.raises(ValueError, match="prefix"):
        TreeTemplate([[0], [0, 1, 0]])
    with pytest.raises(ValueError, match="candidates"):
        TreeTemplate([[0], [0, 0]]).fill(torch.zeros(1, 1, dtype=torch.long))


def test_prune_to_depth_keeps_a_valid_subtree():
    tree = DraftTree(torch.arange(6), torch.tensor([-1, 0, -1, 1, 2, 4]))
    pruned = prune_to_depth(tree, 2)
    assert pruned.tokens.tolist() == [0, 1, 2, 4]
    assert pruned.parents.tolist() == [-1, 0, -1, 2]
    assert prune_to_depth(tree, 10) is tree
    assert len(prune_to_depth(tree, 0)) == 0


def test_to_keeps_a_tree_already_on_the_device():
    # decoding.generate moves every proposed tree to the CPU (a drafter on a GPU builds it there); a tree already
    # on the CPU must not be copied.
    tree = DraftTree(torch.tensor([4, 5]), torch.tensor([-1, 0]), torch.full((2, 8), 0.125))
    assert tree.to(torch.device("cpu")) is tree


def test_greedy_verification_takes_the_first_maximal_token_as_argmax_does():
    """``verify.greedy`` reads each row's argmax through ``max(dim).indices`` (vectorised): on ties it must pick the
    first maximal index and on NaN the first NaN, as ``argmax`` (and so HF ``generate``) does."""
    from decoding import verify

    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        logits = torch.randn(5, 3000, generator=gen)
        if trial % 2:
            logits = logits.round()  # many tied maxima
        if trial % 5 == 0:
            logits[2, 1234] = float("nan")
        tree = DraftTree(torch.randint(0, 3000, (4,), generator=gen), torch.tensor([-1, 0, 0, 1]))
        tree.tokens[:] = logits.argmax(-1)[tree.parents + 1]  # every node right: the deepest path is taken
        verdict = verify.greedy(tree, logits)
        assert verdict.accepted == [0, 1, 3] and verdict.next_token == int(logits.argmax(-1)[4])


def test_greedy_verification_takes_the_deepest_correct_path_and_the_lowest_node_on_ties():
    """Random trees whose siblings often repeat a token (so several paths can be right at once), against every node
    checked on its own: the accepted node is the deepest whose whole root path holds the argmax of each parent's row
    (the lowest index among equally deep ones), and the next token is that node's argmax."""
    import random

    from decoding import verify

    rng = random.Random(0)
    for trial in range(400):
        n, vocab = rng.randint(1, 24), rng.choice([3, 5, 50])
        parents = [rng.randrange(-1, i) for i in range(n)]
        logits = torch.randn(n + 1, vocab, generator=torch.Generator().manual_seed(trial))
        target = logits.argmax(-1).tolist()
        tokens = [target[p + 1] if rng.random() < 0.7 else rng.randrange(vocab) for p in parents]
        verdict = verify.greedy(DraftTree(torch.tensor(tokens), torch.tensor(parents)), logits)

        def path(i):
            return path(parents[i]) + [i] if i >= 0 else []

        right = [i for i in range(n) if all(tokens[j] == target[parents[j] + 1] for j in path(i))]
        best = min(right, key=lambda i: (-len(path(i)), i)) if right else -1
        assert verdict.accepted == path(best), trial
        assert verdict.next_token == target[best + 1], trial
