"""Deleting manifest.json does not switch the checks off: a checkpoint without one is refused
unless the caller asks for it (load(..., verify=False), the CLI's --allow-unverified-json);
and whatever loads, with a manifest or without, holds values the optimizer's constructor
would take (lr >= 0 and finite, 0 <= beta < 1, eps >= 0, a step a whole number >= 0).
Every refusal names the file and the value, and changes nothing."""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch
from torch import nn

import tierlift
from tierlift.checkpoint import format as fmt
from tierlift.checkpoint import manifest


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))


def _trained(offload="none", shard=False):
    model = _model()
    if shard:
        model = tierlift.zero.shard(model, stage=3)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if offload == "none" else
           tierlift.optim.AdamW(model.parameters(), lr=1e-3, offload=offload))
    for _ in range(2):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _state(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            repr(opt.state_dict()["param_groups"]),
            {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
             for i, st in opt.state_dict()["state"].items()})


def _same(a, b):
    assert a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
    assert a[1] == b[1]
    assert a[2].keys() == b[2].keys()
    for i in a[2]:
        for k, v in a[2][i].items():
            assert torch.equal(v, b[2][i][k]) if isinstance(v, torch.Tensor) else v == b[2][i][k]


def _edit_json(file, edit):
    with open(file) as f:
        value = json.load(f)
    edit(value)
    with open(file, "w") as f:
        json.dump(value, f)  # NaN is written as NaN, which json.load reads back


def _set_group(key, value):
    def edit(meta):
        meta["param_groups"][0][key] = value
    return edit


def _load_refused(ck, model, opt, match, **kw):
    before = _state(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the verify=False warning
        with pytest.raises(ValueError, match=match):
            tierlift.checkpoint.load(ck, model, opt, **kw)
    _same(_state(model, opt), before)


BAD_GROUPS = [("lr", -1.0, r"lr is -1\.0; it must be >= 0"),
              ("lr", float("nan"), r"lr is nan; it must be a finite number"),
              ("lr", float("inf"), r"lr is inf; it must be a finite number"),
              ("lr", "0.002", r"lr is '0\.002'; it must be a finite number"),
              ("betas", [1.5, 0.999], r"betas\[0\] is 1\.5; it must be in \[0, 1\)"),
              ("betas", [0.9], r"betas is \[0\.9\]; it must be a pair"),
              ("eps", -1e-8, r"eps is -1e-08; it must be >= 0"),
              ("weight_decay", float("nan"), r"weight_decay is nan"),
              ("amsgrad", 1, r"amsgrad is 1; it must be true or false")]


@pytest.mark.parametrize("manifest_too", [False, True], ids=["no-manifest", "re-signed"])
@pytest.mark.parametrize("key,value,match", BAD_GROUPS, ids=[f"{k}={v}" for k, v, _ in
                                                              BAD_GROUPS])
def test_a_bad_hyperparameter_is_refused_with_or_without_a_manifest(tmp_path, key, value,
                                                                     match, manifest_too):
    model, opt = _trained()
    ck = tmp_path / "ck"
    tierlift.checkpoint.save(ck, model, opt)
    _edit_json(ck / "metadata.json", _set_group(key, value))
    if manifest_too:  # someone who rewrote the manifest as well: the values are still checked
        os.unlink(ck / "manifest.json")
        manifest.write(str(ck))
        _load_refused(ck, model, opt, re.escape(str(ck / "metadata.json")) + ".*" + match)
    else:
        os.unlink(ck / "manifest.json")
        _load_refused(ck, model, opt, "has no manifest.json")
        _load_refused(ck, model, opt, match, verify=False)


def test_a_changed_lr_without_manifest_needs_verify_false(tmp_path):
    """A plausible value (0.001 -> 0.002) cannot be told from a real one by its range: only
    the manifest catches it, so loading without one is an explicit choice."""
    model, opt = _trained()
    ck = tmp_path / "ck"
    tierlift.checkpoint.save(ck, model, opt, extra={"step": 2})
    _edit_json(ck / "metadata.json", _set_group("lr", 0.002))
    os.unlink(ck / "manifest.json")
    _load_refused(ck, model, opt, r"ck has no manifest\.json.*refusing it.*verify=False")
    with pytest.warns(UserWarning, match="has no manifest.json"):
        assert tierlift.checkpoint.load(ck, model, opt, verify=False) == {"step": 2}
    assert opt.param_groups[0]["lr"] == 0.002  # asked for: loaded as it is


@pytest.mark.parametrize("step,ok", [(9.0, True), (-1.0, False), (2.5, False),
                                     (float("nan"), False)])
def test_a_changed_step_in_state_json(tmp_path, step, ok):
    model, opt = _trained("cpu")
    ck = tmp_path / "ck"
    tierlift.checkpoint.save(ck, model, opt)

    def edit(meta):
        meta["groups"][0]["params"][0]["step"] = step

    _edit_json(ck / "optim" / "state.json", edit)
    _load_refused(ck, model, opt, r"state\.json is corrupt")  # the manifest catches any edit
    os.unlink(ck / "manifest.json")
    _load_refused(ck, model, opt, "has no manifest.json")
    if not ok:
        _load_refused(ck, model, opt, re.escape(f"the step is {step!r}; it must be a whole "
                                                "number >= 0"), verify=False)
    opt.close()


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_a_bad_step_tensor_is_refused(tmp_path, shard):
    """A rank file rewritten with its .sha256 (no manifest): the step tensors are checked."""
    model, opt = _trained(shard=shard)
    ck = tmp_path / "ck"
    tierlift.checkpoint.save(ck, model, opt)
    os.unlink(ck / "manifest.json")
    file = ck / "rank00000.pt"
    data = torch.load(file, weights_only=True)
    key = next(k for k in data if k.endswith(".step"))
    data[key] = torch.tensor(-3.0)
    torch.save(data, file)
    fmt.write_checksum(str(ck), 0, fmt.sha256(str(file)))
    _load_refused(ck, model, opt, re.escape(f"{key}: the step is -3.0"), verify=False)


def test_a_sharded_checkpoint_without_manifest(tmp_path):
    model, opt = _trained(shard=True)
    ck = tmp_path / "ck"
    tierlift.checkpoint.save(ck, model, opt, extra={"n": 1})
    _edit_json(ck / "metadata.json", _set_group("betas", [0.9, 1.0]))
    os.unlink(ck / "manifest.json")
    _load_refused(ck, model, opt, "has no manifest.json")
    _load_refused(ck, model, opt, r"betas\[1\] is 1\.0; it must be in \[0, 1\)", verify=False)


def test_a_value_of_another_kind_than_the_optimizer_holds(tmp_path):
    model, opt = _trained()
    ck = tmp_path / "ck"
    tierlift.checkpoint.save(ck, model, opt)
    _edit_json(ck / "metadata.json", _set_group("maximize", 0.5))
    os.unlink(ck / "manifest.json")
    manifest.write(str(ck))
    _load_refused(ck, model, opt, r"maximize is 0\.5; it must be true or false")


@pytest.mark.parametrize("command", ["export", "export-optimizer"])
def test_the_command_line_refuses_a_checkpoint_without_manifest(tmp_path, command, capsys):
    from tierlift.checkpoint.__main__ import main

    model, opt = _trained()
    ck = tmp_path / "ck"
    tierlift.checkpoint.save(ck, model, opt)
    os.unlink(ck / "manifest.json")
    out = tmp_path / "o.pt"
    with pytest.raises(SystemExit):
        main([command, str(ck), str(out)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "has no manifest.json" in err and "--allow-unverified-json" in err, err
    assert not out.exists()
    with pytest.warns(UserWarning, match="has no manifest.json"):
        assert main([command, str(ck), str(out), "--allow-unverified-json"]) == 0
    assert out.exists()
    _edit_json(ck / "metadata.json", _set_group("lr", float("nan")))
    with warnings.catch_warnings(), pytest.raises(SystemExit):
        warnings.simplefilter("ignore")
        main([command, str(ck), str(tmp_path / "o2.pt"), "--allow-unverified-json"])
    assert "lr is nan" in capsys.readouterr().err
    assert not (tmp_path / "o2.pt").exists()


@pytest.mark.parametrize("path", ["", ".", "..", "runs/.."])
def test_a_path_that_names_no_directory_is_refused(tmp_path, monkeypatch, path):
    import tierlift

    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="names no directory"):
        tierlift.checkpoint.save(path, model)
    with pytest.raises(ValueError, match="names no directory"):
        tierlift.checkpoint.load(path, model)
    assert list(tmp_path.iterdir()) == []
