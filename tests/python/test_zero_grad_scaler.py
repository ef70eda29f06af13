"""torch.amp.GradScaler over tierlift.zero shards on 2 gloo ranks: an inf/NaN that only one
rank's gradient shard holds must skip the step on every rank and back the scale off on every
rank, as torch's ShardedGradScaler does for FSDP. Otherwise the ranks' scales drift apart and
the next reduction sums gradients scaled differently (silently wrong weights).

Each case trains the same steps with one inf written into rank 0's first gradient shard on
step 1, then compares with one process training the whole batch with an inf on step 1."""

from __future__ import annotations

import pytest
import torch
from zero_model import batches, make_model, spawn_ranks

import tierlift

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="needs the compiled extension")

BATCH, STEPS, LR = 8, 4, 3e-3
CASES = {  # name: (stage, optimizer, unscale_ and clip first)
    "s2-tierlift": (2, "tierlift", False),
    "s3-tierlift-unscale": (3, "tierlift", True),
    "s2-torch": (2, "torch", False),
    "s2-offload-overlap": (2, "overlap", False),
    "s3-offload-overlap-unscale": (3, "overlap", True),
}


def _optimizer(kind, params):
    if kind == "torch":
        return torch.optim.AdamW(params, lr=LR)
    kw = dict(offload="cpu", overlap=True, chunk_bytes=1 << 12) if kind == "overlap" else {}
    return tierlift.optim.AdamW(params, lr=LR, **kw)


def _fit(model, opt, *, world, rank, zero, unscale, poke_rank):
    """Returns the scale after every step."""
    import torch.nn.functional as F

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scales = []
    for i, seq in enumerate(batches(STEPS, BATCH)):
        opt.zero_grad(set_to_none=True)
        local = seq.chunk(world)[rank]
        loss = F.cross_entropy(model(local[:, :-1]).flatten(0, 1), local[:, 1:].flatten())
        scaler.scale(loss).backward()
        if i == 1 and rank == poke_rank:
            g = next(p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None)
            g.view(-1)[0] = float("inf")
        if unscale:
            scaler.unscale_(opt)
            if zero:
                tierlift.zero.clip_grad_norm_(model, 1.0)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _cases(rank, world, tmp):
    out = {}
    for name, (stage, kind, unscale) in CASES.items():
        model = tierlift.zero.shard(make_model(), stage=stage)
        opt = _optimizer(kind, model.parameters())
        scales = _fit(model, opt, world=world, rank=rank, zero=True, unscale=unscale,
                      poke_rank=0)
        out[name] = (scales, {k: v.clone() for k, v in
                              tierlift.zero.full_state_dict(model).items()})
        if hasattr(opt, "close"):
            opt.close()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_cases, str(tmp_path_factory.mktemp("zero_grad_scaler")))


@pytest.mark.parametrize("name", list(CASES))
def test_inf_on_one_rank_skips_everywhere(ranks, name):
    stage, kind, unscale = CASES[name]
    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    ref_scales = _fit(model, opt, world=1, rank=0, zero=False, unscale=unscale, poke_rank=0)
    ref = model.state_dict()
    for r in range(2):
        scales, sd = ranks[r][name]
        assert scales == ref_scales, (r, scales, ref_scales)
        assert scales[1] == scales[0] / 2  # the poked step backed off
        for k, v in ref.items():
            torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k, r=r: f"rank {r} {k}: {m}")
