"""tierlift.zero under torchrun itself (env:// rendezvous, torchrun's c10d store), the way users
launch it: 2 ranks, stage 3, clipping, a checkpoint, and the losses of a 1-rank replay."""

from __future__ import annotations

import textwrap

import torch

SCRIPT = textwrap.dedent("""
    import tierlift
    from zero_model import batches, make_model, train
    model = tierlift.zero.shard(make_model(), stage=3)
    opt = tierlift.optim.AdamW(model.parameters(), lr=3e-3)
    losses = train(model, opt, batches(4, 8), accum=2, clip=0.5, world=world, rank=rank,
                   zero=True)
    tierlift.checkpoint.save({ckpt!r}, model, opt)
    out = torch.tensor(losses)
""")


def test_torchrun_two_ranks(tmp_path):
    from zero_model import batches, make_model, run_torchrun, train

    import tierlift

    ckpt = tmp_path / "ckpt"
    losses = run_torchrun(SCRIPT, tmp_path, timeout=120, weights_only=True, ckpt=str(ckpt))
    torch.set_num_threads(1)
    ref_model = make_model()
    ref = train(ref_model, tierlift.optim.AdamW(ref_model.parameters(), lr=3e-3),
                batches(4, 8), accum=2, clip=0.5)
    torch.testing.assert_close(losses, torch.tensor(ref), rtol=1e-5, atol=0)
    sd = tierlift.checkpoint.full_state_dict(str(ckpt))
    for key, value in ref_model.state_dict().items():
        torch.testing.assert_close(sd[key], value, rtol=1e-5, atol=1e-6)
