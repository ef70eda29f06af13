"""A whole ZeRO training step at one rank (forward, backward, clip_grad_norm_, optimizer.step,
zero_grad), stages 1-3, with and without a parameter that gets no gradient, over one
micro-batch (tierlift.zero.clip_grad_norm_) or two, the first inside no_sync() (torch's clip),
after a warm-up step that makes the optimizer's state; norms and weights match torch's AdamW on
the unsharded model.

On a GPU (`gpu` marker) the step runs under torch.cuda.set_sync_debug_mode: "error", so any host
sync raises, where torch's own step on the unsharded model makes none; otherwise "warn", and
the ZeRO step may sync only where torch's does plus the reads tierlift's code makes of CUDA
tensors, counted by test_zero_sync.HostReads. On CPU the same body counts those reads (each
would be a sync were the tensor on a GPU): none with every parameter used; with one
unused per block, one read of the flags saying which entries got a gradient (every unit's, the
local gradient checks of every micro-batch ORed in on the device) and one of the optimizer's
step counts, which torch's AdamW keeps on the CPU (no sync on a GPU either).

Outside the checked region: reading the norm clip_grad_norm_ returns (a log line's read: the
caller's own sync, as with torch's clip) and comparing the weights."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_zero_sync import HostReads
from zero_model import batches, make_model

import tierlift

pytestmark = pytest.mark.usefixtures("one_thread")

OPT = dict(lr=3e-3, weight_decay=0.1)
MAX_NORM = 0.5
SYNC = "called a synchronizing"  # torch's sync debug message


def _build(device: str, unused: bool):
    model = make_model(seed=4).to(device)
    if not unused:
        for block in model.blocks:
            del block.unused  # every parameter left gets a gradient
    return model


def _step(model, opt, seqs, zero: bool, clip: str):
    """One optimizer step over the micro-batches `seqs` (all but the last inside no_sync());
    returns the clipped norm, unread."""
    for k, seq in enumerate(seqs):
        last = k == len(seqs) - 1
        with contextlib.nullcontext() if last or not zero else model.no_sync():
            out = model(seq[:, :-1])
            loss = F.cross_entropy(out.flatten(0, 1), seq[:, 1:].flatten()) / len(seqs)
            loss.backward()
    if zero and clip == "tierlift":
        norm = tierlift.zero.clip_grad_norm_(model, MAX_NORM)
    else:  # torch's own clip: global over the shards' ranks once sharded
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


@contextlib.contextmanager
def _sync_debug(device: str, mode: str):
    """Yields the list of the sync warnings torch gives on `device` while inside ("warn"; with
    "error" a sync raises)."""
    if device != "cuda":
        yield []
        return
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(mode)
        try:
            found: list = []
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
        found.extend(w for w in caught if SYNC in str(w.message))


def _train(device, stage, unused, accum, reads, mode=None, steps=3):
    """Per checked step (all but the first): torch's sync warnings, tierlift's reads by call
    site; and the norms and weights. stage None: torch on the unsharded model."""
    zero = stage is not None
    model = _build(device, unused)
    if zero:
        tierlift.zero.shard(model, stage=stage)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    clip = "tierlift" if accum == 1 else "torch"
    syncs, counts, norms = [], [], []
    for i, seq in enumerate(batches(steps, 4 * accum, seed=2)):
        seqs = seq.to(device).chunk(accum)
        if i == 0:
            norms.append(_step(model, opt, seqs, zero, clip))
            continue
        with _sync_debug(device, mode or "warn") as found, reads:
            norms.append(_step(model, opt, seqs, zero, clip))
        syncs.append(len(found))
        counts.append(dict(reads.counts))
    sd = tierlift.zero.full_state_dict(model) if zero else model.state_dict()
    return syncs, counts, [float(n) for n in norms], sd


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("accum", [1, 2], ids=["one_batch", "no_sync_accum"])
@pytest.mark.parametrize("unused", [False, True], ids=["all_used", "unused"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_step_host_syncs(monkeypatch, device, accum, unused, stage):
    reads = HostReads(monkeypatch)
    ref_syncs, _, ref_norms, ref_sd = _train(device, None, unused, accum, reads)
    strict = device == "cuda" and not unused and not any(ref_syncs)
    syncs, counts, norms, sd = _train(device, stage, unused, accum, reads,
                                      mode="error" if strict else "warn")
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    for k, want in ref_sd.items():
        torch.testing.assert_close(sd[k], want, rtol=1e-5, atol=1e-6, msg=k)
    units = len(make_model().blocks)  # each block's unit holds one `unused`
    for step_syncs, step_counts, torch_syncs in zip(syncs, counts, ref_syncs, strict=True):
        if not unused:
            assert step_counts == {}, step_counts  # not one read of any tensor
        else:
            # The agreed flags, every unit's local gradient checks ORed in on the device: one
            # read per step however many units and micro-batches; then the optimizer's step
            # counts, CPU tensors in torch's AdamW, all in one read.
            assert units > 1 and not any(" local_grad() " in k for k in step_counts), step_counts
            flags = {k: n for k, n in step_counts.items() if " settle() tolist " in k}
            assert sum(flags.values()) == 1, step_counts
            assert all(k.endswith(f"[{device}]") for k in flags), step_counts
            counts_read = {k: n for k, n in step_counts.items() if k not in flags}
            assert sum(counts_read.values()) == 1 and all(
                k.startswith("zero/unused.py") and k.endswith("[cpu]") and " _floats() " in k
                for k in counts_read
            ), step_counts
        if device == "cuda":  # every sync beyond torch's own is a counted read
            cuda_reads = sum(n for k, n in step_counts.items() if k.endswith("[cuda]"))
            assert step_syncs <= torch_syncs + cuda_reads, (step_syncs, torch_syncs, step_counts)
