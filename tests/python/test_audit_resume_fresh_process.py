"""A ZeRO-3 model with FP8 delayed-scaling layers (amax histories as buffers) and tierlift's
AdamW with its state on the NVMe tier and a device share, saved in the background mid-run by
tierlift.checkpoint and resumed in a fresh Python process: the losses and weights after the
resume equal the uninterrupted run's bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import tierlift

HERE = os.path.dirname(os.path.abspath(__file__))
SPLIT = 3

# Run both in this process and in the fresh one: the model, the optimizer, the data, the steps.
COMMON = """
import torch
from torch import nn
import tierlift
from tierlift.lowp import convert

def build(seed, nvme, state_dtype, fraction):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(),
                          nn.Linear(32, 32))
    convert(model, "fp8-tensorwise-delayed", min_features=0)
    model = tierlift.zero.shard(model, stage=3, min_unit_numel=1)
    extra = {"overlap": True, "device_fraction": fraction} if fraction else {}
    opt = tierlift.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, offload="nvme",
                               nvme_path=nvme, state_dtype=state_dtype, **extra)
    return model, opt

GEN = torch.Generator().manual_seed(4)
XS = [torch.randn(8, 32, generator=GEN) * c for c in (0.5, 0.8, 1.5, 0.3, 1.0, 0.6)]

def train(model, opt, xs):
    losses = []
    for x in xs:
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return losses
"""

RESUME = """
import sys
torch.set_num_threads(1)
ck, nvme, out, state_dtype, fraction = sys.argv[1:6]
model, opt = build(9, nvme, state_dtype, float(fraction))
extra = tierlift.checkpoint.load(ck, model, opt)
losses = train(model, opt, XS[extra["step"]:])
torch.save({"losses": losses, "full": tierlift.zero.full_state_dict(model)}, out)
"""

ns: dict = {}
exec(compile(COMMON, "resume_common", "exec"), ns)


@pytest.mark.parametrize(("state_dtype", "saved_fraction", "loaded_fraction"),
                         [("fp32", 0.4, 0.0), ("bf16", 0.0, 0.5)])
def test_background_save_resumes_in_a_fresh_process(tmp_path, one_thread, state_dtype,
                                                    saved_fraction, loaded_fraction):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model, opt = ns["build"](0, str(tmp_path / "a"), state_dtype, saved_fraction)
    ns["train"](model, opt, ns["XS"][:SPLIT])
    ck = str(tmp_path / "ck")
    handle = tierlift.checkpoint.save(ck, model, opt, blocking=False, extra={"step": SPLIT},
                                      staging_budget=64 << 10)
    want = ns["train"](model, opt, ns["XS"][SPLIT:])  # steps on while the files are written
    handle.wait()
    full = tierlift.zero.full_state_dict(model)
    out = str(tmp_path / "out.pt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"),
         os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", COMMON + RESUME, ck, str(tmp_path / "b"), out,
                    state_dtype, str(loaded_fraction)], check=True, env=env, timeout=300)
    got = torch.load(out, weights_only=True)
    for i, (a, b) in enumerate(zip(want, got["losses"], strict=True)):
        assert torch.equal(a, b), f"loss {i} after the resume off by {(a - b).abs().item()}"
    assert full.keys() == got["full"].keys()
    assert any("amax_history" in k for k in full)
    for k, v in full.items():
        assert torch.equal(v, got["full"][k]), f"{k} off by {(v - got['full'][k]).abs().max()}"
