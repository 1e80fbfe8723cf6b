"""Golden cases for plan_paths: which root-to-leaf paths a tree pass attends along."""

from specdecode.models.path_attention import plan_paths
from specdecode.core.trees import build_tree, chain_tree, tree_attention

# root ─┬─ 1 = (0,) ─┬─ 3 = (0, 0) ── 5 = (0, 0, 0)
#       │            └─ 4 = (0, 1)
#       └─ 2 = (1,)
EXAMPLE = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]


def as_lists(plans):
    return [(p.nodes.tolist(), p.queries.tolist(), p.first_query) for p in plans]


def test_each_node_is_answered_once_along_its_own_path():
    _, mask = tree_attention(build_tree(EXAMPLE), start=7)
    assert as_lists(plan_paths(mask, start=7)) == [
        ([0, 2], [0, 2], 0),  # leaf 2
        ([0, 1, 4], [1, 4], 1),  # leaf 4: the root was answered with leaf 2
        ([0, 1, 3, 5], [3, 5], 2),  # leaf 5
    ]


def test_a_batch_of_one_mask_plans_the_same():
    _, mask = tree_attention(build_tree(EXAMPLE), start=3)
    assert as_lists(plan_paths(mask[None], start=3)) == as_lists(plan_paths(mask, start=3))


def test_chains_and_non_trees_attend_in_one_pass():
    _, mask = tree_attention(chain_tree(4), start=5)
    assert plan_paths(mask, start=5) is None  # already the layout of plain decoding
    _, mask = tree_attention(build_tree(EXAMPLE), start=2)
    hidden_prefix = mask.clone()
    hidden_prefix[3, 0] = False
    assert plan_paths(hidden_prefix, start=2) is None
    not_a_tree = mask.clone()
    not_a_tree[5, 2 + 2] = True  # node 5 also sees node 2, which is not its ancestor
    assert plan_paths(not_a_tree, start=2) is None
    assert plan_paths(mask.expand(2, -1, -1), start=2) is None  # per-row trees: one pass
