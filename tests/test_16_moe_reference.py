"""The reference of chapter 16: dispatch and combine worked by hand, and the routing of each
checked case."""
import numpy as np
import pytest

from common.moe import reference as ref


def test_dispatch_and_combine_by_hand():
    # 2 ranks, 4 experts: rank 0 hosts 0-1, rank 1 hosts 2-3
    a, b, c = (np.full((1, 2), v) for v in (1, 2, 3))
    indices = [np.array([[0, 2], [1, 0]]), np.array([[3, 1]])]
    rows = [np.concatenate([a, b]), c]
    got, counts = ref.dispatch(0, 2, 4, indices, rows)
    assert counts.tolist() == [2, 2]  # expert 0: a, b (rank 0); expert 1: b (rank 0), c (rank 1)
    assert got[:, 0].tolist() == [1, 2, 2, 3]
    got, counts = ref.dispatch(1, 2, 4, indices, rows)
    assert counts.tolist() == [1, 1] and got[:, 0].tolist() == [1, 3]
    out = ref.combine(np.array([[0, 2]]), np.array([[0.25, 0.75]], np.float32),
                      np.array([[[4.0], [8.0]]], np.float32))
    assert out.tolist() == [[7.0]]


@pytest.mark.parametrize("case", list(ref.CASES))
def test_routing_of_each_case(case):
    world, tokens, experts, topk = 4, 16, 16, 3
    routes = [ref.routing(case, 7, r, world, tokens, experts, topk) for r in range(world)]
    for r, (indices, weights) in enumerate(routes):
        assert indices.shape[1] == topk and weights.shape == indices.shape
        assert len(indices) <= tokens and ((0 <= indices) & (indices < experts)).all()
        assert (np.diff(np.sort(indices, axis=1), axis=1) > 0).all()  # distinct experts
        assert np.allclose(weights.sum(axis=1), 1)
    used = np.concatenate([i.ravel() for i, _ in routes])
    sizes = [len(i) for i, _ in routes]
    if case == "empty-expert":
        assert len(set(used.tolist())) == experts - 1
    if case == "one-expert":
        assert (np.bincount(used, minlength=experts)[:topk] == world * tokens).all()
    if case == "silent-rank":
        assert sizes == [tokens] * (world - 1) + [0]
    if case == "fewer":
        assert max(sizes) < tokens
    assert ref.routing(case, 7, 1, world, tokens, experts, topk)[0].tolist() == \
        routes[1][0].tolist()  # the same seed, the same routing on every rank
