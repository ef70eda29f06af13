"""Durable NVMe optimizer state (durable=True) that cannot be reopened is refused before anything
in its folder changes, never taken for a new state: a missing, empty or truncated manifest, a
manifest whose data files are gone. durable="fresh" is the explicit way to start over; a new
state killed before its first manifest starts again on its own."""

from __future__ import annotations

import os
import signal
import warnings

import forkserver
import pytest
import torch

import tierlift
from tierlift.io import ChecksumError
from tierlift.offload import OffloadConfig, durable
from tierlift.optim import AdamW

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

GENS = [1, 2]


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).requires_grad_() for s in [(3000,), (70, 41)]]


def _opt(params, path, gens, mode=True):
    return AdamW(params, lr=1e-2, offload="nvme", nvme_path=str(path), cpu_budget=1 << 20,
                 chunk_bytes=4096, nvme_generations=gens, durable=mode)


def _trained(path, gens, steps=2):
    """A closed durable state after `steps` steps, and the parameters it committed."""
    params = _params()
    opt = _opt(params, path, gens)
    for s in range(steps):
        g = torch.Generator().manual_seed(100 + s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    opt.close()
    return [p.detach().clone() for p in params]


def _files(state) -> dict[str, bytes]:
    """Every file of the folder and its bytes (owner.json aside: a lock, not state)."""
    return {n: (state / n).read_bytes() for n in sorted(os.listdir(state)) if n != "owner.json"}


def _reopens_at(path, gens, committed, steps=2):
    params = _params()
    with pytest.warns(RuntimeWarning, match=f"after {steps} committed steps"):
        opt = _opt(params, path, gens)
    assert all(torch.equal(p, c) for p, c in zip(params, committed))
    opt.close()


@pytest.mark.parametrize("gens", GENS)
def test_missing_manifest_is_refused_and_the_files_kept(tmp_path, gens):
    committed = _trained(tmp_path, gens)
    state = tmp_path / "tierlift-durable-rank0"
    manifest = (state / "manifest.json").read_bytes()
    (state / "manifest.json").unlink()
    before = _files(state)
    with pytest.raises(ValueError, match=rf"folder '{state}' holds state files \(.*\) but no "
                                         r"manifest\.json.* pass durable='fresh' to discard"):
        _opt(_params(), tmp_path, gens)
    assert _files(state) == before  # nothing zeroed, nothing written
    assert not (state / "owner.json").exists()
    (state / "manifest.json").write_bytes(manifest)  # put back: the 2 steps are all there
    _reopens_at(tmp_path, gens, committed)


@pytest.mark.parametrize("left", ["journal", "intent"])
def test_a_journal_or_intent_alone_is_refused(tmp_path, left):
    """One generation: the journal (or an intent) of a step without its manifest."""
    _trained(tmp_path, 1)
    state = tmp_path / "tierlift-durable-rank0"
    for name in os.listdir(state):
        if not name.startswith("journal."):
            os.unlink(state / name)
    if left == "intent":
        for name in os.listdir(state):
            os.unlink(state / name)
        durable._write_json(str(state / "intent.json"), {"seq": 1, "groups": {}})
    before = _files(state)
    with pytest.raises(ValueError, match="but no manifest.json"):
        _opt(_params(), tmp_path, 1)
    assert _files(state) == before


@pytest.mark.parametrize("gens", GENS)
@pytest.mark.parametrize("how", ["empty", "truncated"])
def test_empty_or_truncated_manifest_is_refused(tmp_path, gens, how):
    _trained(tmp_path, gens)
    state = tmp_path / "tierlift-durable-rank0"
    raw = (state / "manifest.json").read_bytes()
    (state / "manifest.json").write_bytes(b"" if how == "empty" else raw[:len(raw) // 2])
    before = _files(state)
    with pytest.raises(ChecksumError, match="CRC-32 does not match.*durable='fresh'"):
        _opt(_params(), tmp_path, gens)
    assert _files(state) == before


@pytest.mark.parametrize("gens,missing", [(1, "g0.exp_avg.0"), (1, "g0.grads"),
                                          (1, "journal.records"), (2, "g0.exp_avg_sq.1")])
def test_manifest_without_its_data_files_is_refused(tmp_path, gens, missing):
    _trained(tmp_path, gens)
    state = tmp_path / "tierlift-durable-rank0"
    (state / missing).unlink()
    before = _files(state)
    with pytest.raises(ValueError, match=f"{missing}.*cannot be reopened"):
        _opt(_params(), tmp_path, gens)
    assert _files(state) == before


@pytest.mark.parametrize("gens", GENS)
def test_fresh_discards_the_state_on_purpose(tmp_path, gens):
    _trained(tmp_path, gens)
    state = tmp_path / "tierlift-durable-rank0"
    (state / "manifest.json").unlink()
    (state / "g7.master.0").write_bytes(b"x" * 4096)  # a file of another layout
    params = _params()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "reopened" warning
        opt = _opt(params, tmp_path, gens, mode="fresh")
    assert not opt.state  # no step counts: a new state
    assert torch.equal(params[0], _params()[0])  # the parameters keep their values
    names = set(os.listdir(state))
    assert "g7.master.0" not in names and durable.CREATING not in names
    assert "manifest.json" in names and "intent.json" not in names
    opt.close()
    # From then on durable=True reopens the new state, at 0 steps.
    _reopens_at(tmp_path, gens, _params(), steps=0)
    # A committed state is discarded too, when asked.
    with pytest.warns(RuntimeWarning, match="after 0 committed steps"):
        _trained(tmp_path, gens)
    opt = _opt(_params(), tmp_path, gens, mode="fresh")
    assert not opt.state
    opt.close()


def test_fresh_refuses_a_folder_in_use(tmp_path):
    params = _params()
    opt = _opt(params, tmp_path, 1)
    state = tmp_path / "tierlift-durable-rank0"
    before = _files(state)
    with pytest.raises(RuntimeError, match="in use by pid"):
        _opt(_params(), tmp_path, 1, mode="fresh")
    assert _files(state) == before
    opt.close()


def test_durable_values_are_checked(tmp_path):
    for bad in ("Fresh", "new", 1, None):
        with pytest.raises(ValueError, match="durable must be True, False or 'fresh'"):
            OffloadConfig(offload="nvme", nvme_path=str(tmp_path), durable=bad)
    with pytest.raises(ValueError, match="durable='fresh' needs offload='nvme'"):
        AdamW(_params(), offload="cpu", durable="fresh")


def _killed_at_first_manifest(path, gens):
    """Builds a new durable state and kills itself as its first manifest is renamed."""
    torch.set_num_threads(1)
    replace = os.replace

    def kill_at_manifest(src, dst):
        if os.path.basename(dst) == "manifest.json":
            os.kill(os.getpid(), signal.SIGKILL)
        replace(src, dst)

    os.replace = kill_at_manifest
    _opt(_params(), path, gens)


_CTX = forkserver.CTX  # children fork from a clean, preloaded server (forkserver.py)


@pytest.mark.parametrize("gens", GENS)
def test_new_state_killed_before_its_first_manifest_starts_again(tmp_path, gens):
    proc = _CTX.Process(target=_killed_at_first_manifest, args=(tmp_path, gens))
    proc.start()
    proc.join()
    assert proc.exitcode == -signal.SIGKILL
    state = tmp_path / "tierlift-durable-rank0"
    assert durable.CREATING in os.listdir(state) and "manifest.json" not in os.listdir(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        opt = _opt(_params(), tmp_path, gens)
    assert durable.CREATING not in os.listdir(state)
    opt.close()


def test_a_stale_marker_beside_a_manifest_hides_nothing(tmp_path):
    """A kill between a new state's first manifest and its marker's removal leaves both: the
    state reopens, the marker goes, and a manifest lost later is refused as any other."""
    committed = _trained(tmp_path, 1)
    state = tmp_path / "tierlift-durable-rank0"
    durable._write_json(str(state / durable.CREATING), {"format": durable.FORMAT})
    raw = (state / "manifest.json").read_bytes()
    (state / "manifest.json").write_bytes(raw[:10])
    before = _files(state)
    with pytest.raises(ChecksumError, match="CRC-32 does not match"):  # refused: all kept
        _opt(_params(), tmp_path, 1)
    assert _files(state) == before
    (state / "manifest.json").write_bytes(raw)
    _reopens_at(tmp_path, 1, committed)
    assert durable.CREATING not in os.listdir(state)
    (state / "manifest.json").unlink()
    with pytest.raises(ValueError, match="but no manifest.json"):
        _opt(_params(), tmp_path, 1)
