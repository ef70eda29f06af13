"""Durable NVMe optimizer state (durable=True): a process killed with SIGKILL at any point of a
step reopens at exactly the previous step or the next one, never a mix, for one and two
generations, fp32 and compact state; a corrupt manifest, intent, gradient log or journal copy
is refused with a ChecksumError.

The kill points are the I/O calls themselves: a forked child counts every IoEngine.write,
os.pwrite and os.replace (before and after each) and kills itself at the chosen one, so kills
land with writes in flight, records half way, renames pending."""

from __future__ import annotations

import os
import random
import shutil
import signal
import warnings

import forkserver
import pytest
import torch

import tierlift
from tierlift.io import ChecksumError, IoEngine
from tierlift.offload import durable
from tierlift.optim import AdamW

pytestmark = pytest.mark.skipif(not tierlift._extension.available(),
                                reason="compiled extension not loaded")

STEPS = 3
CASES = {  # name: (nvme_generations, state_dtype, param dtype)
    "1gen": (1, "fp32", torch.float32),
    "1gen-compact-bf16": (1, "bf16", torch.bfloat16),
    "2gen": (2, "fp32", torch.float32),
}


def _params(dtype):
    g = torch.Generator().manual_seed(0)
    shapes = [(3000,), (70, 41), (1024,), (5,)]  # several params per chunk, and across chunks
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        p.grad = None if (step == 1 and i == 3) else torch.randn(p.shape, generator=g).to(p.dtype)


def _opt(params, path, gens, state_dtype, **kw):
    return AdamW(params, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, offload="nvme",
                 nvme_path=str(path), cpu_budget=1 << 20, chunk_bytes=4096,
                 nvme_generations=gens, durable=True, **kw)


def _references(case):
    """(params, state dict) after 0 .. STEPS steps of the in-memory optimizer."""
    gens, state_dtype, dtype = CASES[case]
    params = _params(dtype)
    opt = AdamW(params, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
    out = [_snapshot(params, opt)]
    for s in range(STEPS):
        _grads(params, s)
        opt.step()
        out.append(_snapshot(params, opt))
    return out


def _snapshot(params, opt):
    """Parameters and state dict, copied (a state dict holds the live state tensors)."""
    sd = opt.state_dict()
    sd["state"] = {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}
    return [p.detach().clone() for p in params], sd


def _same(got, ref) -> bool:
    (gp, gsd), (rp, rsd) = got, ref
    if not all(torch.equal(a, b) for a, b in zip(gp, rp)):
        return False
    if gsd["state"].keys() != rsd["state"].keys():
        return False
    return all(st.keys() == gsd["state"][i].keys()
               and all(torch.equal(v, gsd["state"][i][k]) for k, v in st.items())
               for i, st in rsd["state"].items())


def _child(path, case, kill_at, trace, reopen_only=False):
    """Trains STEPS steps (or only reopens the state, `reopen_only`), killing itself at I/O
    event `kill_at`; writes the steps it finished to path/done, and with `trace` the event
    names to path/trace."""
    torch.set_num_threads(1)
    gens, state_dtype, dtype = CASES[case]
    events = []

    def event(name):
        events.append(name)
        if len(events) - 1 == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(fn, name_of):
        def wrapped(*args, **kwargs):
            event("before " + name_of(*args))
            out = fn(*args, **kwargs)
            event("after " + name_of(*args))
            return out
        return wrapped

    IoEngine.write = wrap(IoEngine.write, lambda self, t, p, o=0: f"write {os.path.basename(p)}")
    os.pwrite = wrap(os.pwrite, lambda fd, data, off: "pwrite record")
    os.replace = wrap(os.replace, lambda a, b: f"replace {os.path.basename(b)}")
    params = _params(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        opt = _opt(params, path / "state", gens, state_dtype)
    for s in range(0 if reopen_only else STEPS):
        _grads(params, s)
        opt.step()
        with open(path / "done", "w") as f:
            f.write(str(s + 1))
    if trace:
        with open(path / "trace", "w") as f:
            f.write("\n".join(events))


_CTX = forkserver.CTX  # children fork from a clean, preloaded server (forkserver.py)


def _run(path, case, kill_at=-1, trace=False, reopen_only=False) -> int:
    """The child's exit code: 0 when it finished, -SIGKILL when it killed itself."""
    (path / "state").mkdir(exist_ok=True)
    proc = _CTX.Process(target=_child, args=(path, case, kill_at, trace, reopen_only))
    proc.start()
    proc.join()
    return proc.exitcode


def _reopen(path, case):
    gens, state_dtype, dtype = CASES[case]
    params = _params(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        opt = _opt(params, path / "state", gens, state_dtype)
    return params, opt


def _trace(tmp_path, case) -> list[str]:
    run = tmp_path / "trace-run"
    run.mkdir()
    assert _run(run, case, trace=True) == 0
    return (run / "trace").read_text().splitlines()


@pytest.mark.parametrize("case", list(CASES))
def test_kill_anywhere_reopens_at_previous_or_next_step(tmp_path, case):
    refs = _references(case)
    events = _trace(tmp_path, case)
    rng = random.Random(1234)
    # Every event of the last step (first and middle steps are sampled): 3 steps' worth of
    # writes, records and renames on a model of 6 chunks.
    picks = sorted(set(rng.sample(range(len(events)), min(40, len(events)))
                       + list(range(len(events) * 2 // 3, len(events)))))
    outcomes = {"previous": 0, "next": 0}
    paths = {"kept": 0, "redone": 0, "from_journal": 0}
    for k in picks:
        trial = tmp_path / f"kill{k}"
        trial.mkdir()
        status = _run(trial, case, kill_at=k)
        assert status == -signal.SIGKILL, (k, status)
        done = int((trial / "done").read_text()) if (trial / "done").exists() else 0
        params, opt = _reopen(trial, case)
        got = _snapshot(params, opt)
        matches = [n for n, ref in enumerate(refs) if _same(got, ref)]
        assert matches and set(matches) <= {done, done + 1}, (k, events[k], done, matches)
        outcomes["previous" if done in matches else "next"] += 1
        for key in paths:
            paths[key] += opt._offload._durable.reopened.get(key, 0)
        if k == picks[-1] or k % 7 == 0:  # the reopened optimizer trains on, exactly
            n = max(matches)
            if n < STEPS:
                _grads(params, n)
                opt.step()
                assert _same(_snapshot(params, opt), refs[n + 1])
        opt.close()
    assert outcomes["previous"] and outcomes["next"], outcomes
    if CASES[case][0] == 1:  # every way of finishing a step was taken
        assert all(paths.values()), paths


def _killed_mid_step(tmp_path, case, event_name, nth=0):
    """A state folder killed right after the nth event named `event_name` of the last step
    (the events between the last two manifests)."""
    events = _trace(tmp_path, case)
    commits = [i for i, e in enumerate(events) if e == "after replace manifest.json"]
    k = [i for i in range(commits[-2], commits[-1]) if events[i] == event_name][nth]
    trial = tmp_path / "killed"
    trial.mkdir()
    assert _run(trial, case, kill_at=k) == -signal.SIGKILL
    return trial / "state" / "tierlift-durable-rank0"


def test_corrupt_gradient_log_is_refused(tmp_path):
    state = _killed_mid_step(tmp_path, "1gen", "after replace intent.json")
    with open(state / "g0.grads", "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumError, match="gradient journal .* is corrupt"):
        _reopen(tmp_path / "killed", "1gen")
    # Refused, not taken: the folder is left as it was, for a retry or an inspection.
    assert (state / "intent.json").exists()


def _tear_last_recorded_chunk(state) -> None:
    """Overwrites the start of the master of the chunk recorded last (its journal copy is
    complete: a record is written only after it), as a kill mid-write would leave it."""
    intent = durable._read_json(str(state / "intent.json"))
    raw = (state / "journal.records").read_bytes()
    recorded = []
    for ci in range(len(raw) // 64):
        body = raw[ci * 64:ci * 64 + durable._REC.size]
        magic, seq, gi, rci, *_ = durable._REC.unpack(body)
        if magic == durable._MAGIC and seq == intent["seq"]:
            recorded.append(rci)
    with open(state / "g0.master.0", "r+b") as f:
        f.seek(max(recorded) * 4096)
        f.write(os.urandom(4096))


@pytest.mark.parametrize("corrupt", [False, True])
def test_torn_chunk_is_finished_from_its_journal_copy(tmp_path, corrupt):
    state = _killed_mid_step(tmp_path, "1gen", "after pwrite record", nth=1)
    _tear_last_recorded_chunk(state)
    if corrupt:
        data = (state / "journal.master").read_bytes()
        (state / "journal.master").write_bytes(bytes(b ^ 0xFF for b in data))
        with pytest.raises(ChecksumError, match="journal copy does not match"):
            _reopen(tmp_path / "killed", "1gen")
        return
    params, opt = _reopen(tmp_path / "killed", "1gen")
    assert opt._offload._durable.reopened["from_journal"] == 1
    assert _same(_snapshot(params, opt), _references("1gen")[STEPS])


def test_reopen_killed_half_way_is_finished_by_the_next_reopen(tmp_path):
    """Killed right after its intent (every chunk still to be stepped), then three reopens
    each killed half way through their own work (journal writes, records, in-place writes):
    the last reopen still lands exactly on the next step."""
    _killed_mid_step(tmp_path, "1gen", "after replace intent.json")
    killed = tmp_path / "killed"
    for i in range(3):
        probe = tmp_path / f"probe{i}"
        shutil.copytree(killed, probe)
        assert _run(probe, "1gen", trace=True, reopen_only=True) == 0
        events = (probe / "trace").read_text().splitlines()
        assert any(e.startswith("before write journal.") for e in events)
        status = _run(killed, "1gen", kill_at=len(events) // 2, reopen_only=True)
        assert status == -signal.SIGKILL
    params, opt = _reopen(killed, "1gen")
    assert _same(_snapshot(params, opt), _references("1gen")[STEPS])


@pytest.mark.parametrize("name", ["manifest.json", "intent.json"])
def test_corrupt_manifest_or_intent_is_refused(tmp_path, name):
    state = _killed_mid_step(tmp_path, "1gen", "after replace intent.json")
    raw = bytearray((state / name).read_bytes())
    raw[20] ^= 0x01
    (state / name).write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="CRC-32 does not match"):
        _reopen(tmp_path / "killed", "1gen")


def test_reopen_refuses_other_layouts_and_live_owners(tmp_path):
    params = _params(torch.float32)
    opt = _opt(params, tmp_path, 1, "fp32")
    with pytest.raises(RuntimeError, match="in use by pid"):
        _opt(_params(torch.float32), tmp_path, 1, "fp32")
    opt.close()
    with pytest.raises(ValueError, match="written for other parameters"):
        _opt([torch.zeros(10, requires_grad=True)], tmp_path, 1, "fp32")
    with pytest.raises(ValueError, match="written for other parameters"):
        _opt(_params(torch.float32), tmp_path, 2, "fp32")
    _opt(_params(torch.float32), tmp_path, 1, "fp32").close()  # as built before: reopens
    with pytest.raises(ValueError, match="durable=True needs offload='nvme'"):
        AdamW(_params(torch.float32), offload="cpu", durable=True)


def test_disk_bytes_of_one_durable_generation(tmp_path):
    """12 B/param of fp32 state, plus the gradient log at the gradients' width, plus one chunk
    of every kind per pipeline slot and 64 B per chunk of records."""
    n = 1 << 20
    for dtype, state_dtype, per_param in [(torch.float32, "fp32", 12 + 4),
                                          (torch.bfloat16, "fp32", 12 + 2),
                                          (torch.bfloat16, "bf16", 7.015625 + 2)]:
        folder = tmp_path / f"{dtype}-{state_dtype}"
        folder.mkdir()
        p = torch.zeros(n, dtype=dtype, requires_grad=True)
        opt = AdamW([p], state_dtype=state_dtype, offload="nvme", nvme_path=str(folder),
                    cpu_budget=8 << 20, nvme_generations=1, durable=True)
        state = folder / "tierlift-durable-rank0"
        disk = sum(os.stat(state / f).st_blocks * 512 for f in os.listdir(state)
                   if not f.endswith(".json"))
        journal = sum(os.stat(state / f).st_blocks * 512 for f in os.listdir(state)
                      if f.startswith("journal."))
        off = opt._offload
        stored = len(off.layouts[0].chunks) * off.chunk_elems  # the last chunk rounded up
        assert stored < n * 1.1
        assert journal <= off.n_slots * off.chunk_elems * 12 + 4096  # + the records
        assert (disk - journal) / stored == pytest.approx(per_param, abs=0.02), (dtype,
                                                                                state_dtype)
        opt.close()
