"""FeatureStore used the way a PyG / DGL user would, checked against plain torch indexing
(`features[index]`), which is the reference: where tierlift cannot give the same result it
refuses, before anything is written."""

import pytest
import torch

import tierlift
from tierlift.gnn import FeatureStore

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")


def test_out_that_requires_grad_is_refused_before_writing():
    # Plain torch refuses out= that requires grad (index_select(..., out=) raises); written
    # in place, out would keep its old autograd history and send gradient to what made it.
    x = torch.randn(10, 4)
    store = FeatureStore(x, device="cpu")
    index = torch.tensor([1, 7])
    w = torch.ones(2, 4, requires_grad=True)
    out = w * 2
    with pytest.raises(RuntimeError, match="out=... arguments don't support"):
        torch.index_select(x, 0, index, out=out)
    with pytest.raises(ValueError, match="out requires grad"):
        store.gather(index, out=out)
    assert torch.equal(out, torch.full((2, 4), 2.0))  # not written
    leaf = torch.zeros(2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="out requires grad"):
        store.gather(index, out=leaf)
    assert not leaf.detach().any()
    plain = torch.zeros(2, 4)
    assert store.gather(index, out=plain) is plain and torch.equal(plain, x[index])

