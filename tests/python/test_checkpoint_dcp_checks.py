"""import-dcp checks what torch.distributed.checkpoint records before it accepts a checkpoint:
DCP keeps no checksum, so a flipped byte in a data file, a truncated data file, an item of
another dtype or shape than .metadata says are errors naming the file (nothing is written),
and the command's output says what was and was not checked. .metadata, a pickle, is read by
a restricted unpickler: one that would run code is refused, a genuine one imports."""

from __future__ import annotations

import os
import pickle
import warnings

import dcp_source
import pytest
import torch
from torch import nn

import tierlift
from tierlift.checkpoint.__main__ import main


def _data_file(dcp_dir) -> str:
    (name,) = [n for n in os.listdir(dcp_dir) if n.endswith(".distcp")]
    return os.path.join(dcp_dir, name)


def _import_fails(dcp_dir, out, capsys, *match):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        with pytest.raises(SystemExit) as e:
            main(["import-dcp", str(dcp_dir), str(out)])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert e.value.code == 2 and "Traceback" not in err, err
    for m in match:
        assert m in last, last
    assert not os.path.lexists(out) and not os.path.lexists(f"{out}.tmp")


def test_a_flipped_byte_in_a_tensor_is_refused(tmp_path, capsys):
    model = dcp_source.model()
    dcp_dir = dcp_source.save(model.state_dict(), tmp_path / "dcp")
    file = _data_file(dcp_dir)
    data = bytearray(open(file, "rb").read())
    weight = model.state_dict()["0.weight"].numpy().tobytes()
    at = data.find(weight) + 17  # a byte inside the tensor's values
    data[at] ^= 0x01
    open(file, "wb").write(bytes(data))
    _import_fails(dcp_dir, tmp_path / "ck", capsys, f"{file} is corrupt: the item of '0.weight'",
                  "Bad CRC-32")


def test_a_truncated_data_file_names_it(tmp_path, capsys):
    dcp_dir = dcp_source.save(dcp_source.model().state_dict(), tmp_path / "dcp")
    file = _data_file(dcp_dir)
    size = os.path.getsize(file)
    os.truncate(file, size - 100)
    _import_fails(dcp_dir, tmp_path / "ck", capsys, f"{file} is truncated or corrupt: "
                  f"{size - 100} bytes, but {dcp_dir}/.metadata places '1.bias' at bytes")
    os.unlink(file)
    _import_fails(dcp_dir, tmp_path / "ck", capsys, f"{file} is missing")


def test_an_item_of_another_dtype_is_refused(tmp_path, capsys):
    """DCP's own reader copies the item into a tensor of the recorded dtype, casting it."""
    sd = {"w": torch.randn(4, 3, dtype=torch.float64)}
    dcp_dir = dcp_source.save(sd, tmp_path / "dcp")
    meta_file = dcp_dir / ".metadata"
    meta = pickle.loads(meta_file.read_bytes())
    meta.state_dict_metadata["w"].properties.dtype = torch.float32
    meta_file.write_bytes(pickle.dumps(meta))
    _import_fails(dcp_dir, tmp_path / "ck", capsys,
                  "the item of 'w'", "holds torch.float64 [4, 3], but .metadata says "
                  "torch.float32 [4, 3]")


def test_chunks_that_leave_a_gap_are_refused(tmp_path, capsys):
    dcp_dir = dcp_source.save({"w": torch.randn(4, 3)}, tmp_path / "dcp")
    meta_file = dcp_dir / ".metadata"
    meta = pickle.loads(meta_file.read_bytes())
    meta.state_dict_metadata["w"].size = torch.Size([5, 3])  # a row no chunk holds
    meta_file.write_bytes(pickle.dumps(meta))
    _import_fails(dcp_dir, tmp_path / "ck", capsys, "the chunks of 'w' do not cover it")


def test_an_intact_import_says_what_was_checked(tmp_path, capsys):
    model = dcp_source.model()
    dcp_dir = dcp_source.save(model.state_dict(), tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        assert main(["import-dcp", str(dcp_dir), str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "keeps no checksum of its own" in out and "CRC-32" in out, out
    fresh = dcp_source.model(0)
    tierlift.checkpoint.load(tmp_path / "ck", fresh)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())


def test_items_written_without_crc_still_import(tmp_path):
    from torch.utils.serialization import config

    model = dcp_source.model()
    with config.patch({"save.compute_crc32": False}):
        dcp_dir = dcp_source.save(model.state_dict(), tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        assert main(["import-dcp", str(dcp_dir), str(tmp_path / "ck")]) == 0
    fresh = dcp_source.model(0)
    tierlift.checkpoint.load(tmp_path / "ck", fresh)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())


def test_a_tensor_in_chunks_is_put_together(tmp_path):
    """A sharded save (FSDP, DTensor) stores a tensor as chunks at offsets: two items of one
    file made into the two halves of one tensor."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    top, bottom = torch.randn(2, 3), torch.randn(2, 3)
    dcp_dir = dcp_source.save({"a": top, "b": bottom}, tmp_path / "dcp")
    meta_file = dcp_dir / ".metadata"
    meta = pickle.loads(meta_file.read_bytes())
    items = {i.fqn: info for i, info in meta.storage_data.items()}
    chunks = [ChunkStorageMetadata(offsets=torch.Size([r, 0]), sizes=torch.Size([2, 3]))
              for r in (0, 2)]
    meta.state_dict_metadata = {"w": TensorStorageMetadata(
        properties=meta.state_dict_metadata["a"].properties, size=torch.Size([4, 3]),
        chunks=chunks)}
    meta.storage_data = {MetadataIndex("w", c.offsets, i): items[n]
                         for i, (c, n) in enumerate(zip(chunks, "ab"))}
    meta_file.write_bytes(pickle.dumps(meta))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        assert main(["import-dcp", str(dcp_dir), str(tmp_path / "ck")]) == 0
    model = nn.Module()
    model.register_buffer("w", torch.zeros(4, 3))
    tierlift.checkpoint.load(tmp_path / "ck", model)
    assert torch.equal(model.w, torch.cat([top, bottom]))


class _Runs:
    """Unpickles as fn(*args): what a crafted .metadata does to run code."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize("where", ["top", "inside"])
def test_a_metadata_that_would_run_code_is_refused(tmp_path, capsys, where):
    """.metadata is a pickle: DCP's reader unpickles it whole, so a crafted one runs what it
    names. Here os.system (writing a marker file), as the whole file or hidden among genuine
    metadata; refused, naming it, and never called."""
    import builtins

    marker = tmp_path / "ran"
    dcp_dir = dcp_source.save(dcp_source.model().state_dict(), tmp_path / "dcp")
    meta_file = dcp_dir / ".metadata"
    if where == "top":
        payload, named = _Runs(os.system, f"touch {marker}"), f"{os.system.__module__}.system"
    else:
        meta = pickle.loads(meta_file.read_bytes())
        meta.planner_data = {"0.weight": _Runs(builtins.exec, f"open({str(marker)!r}, 'w')")}
        payload, named = meta, "builtins.exec"
    meta_file.write_bytes(pickle.dumps(payload))
    _import_fails(dcp_dir, tmp_path / "ck", capsys,
                  f"{meta_file} names {named}, which a torch.distributed.checkpoint's metadata "
                  "does not hold; refusing to load it")
    assert not marker.exists()


def test_a_genuine_metadata_of_every_kind_imports(tmp_path):
    """The restricted unpickler takes what DCP writes: dtypes, scalars, non-tensor values,
    nested names."""
    state = {"f32": torch.randn(3, 4), "bf16": torch.randn(5).bfloat16(),
             "i64": torch.tensor(7), "u8": torch.arange(6, dtype=torch.uint8).view(2, 3),
             "nested": {"t": torch.ones(2)}, "count": 3, "name": "x", "blob": b"\0\1"}
    dcp_dir = dcp_source.save(state, tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        assert main(["import-dcp", str(dcp_dir), str(tmp_path / "ck")]) == 0
    got = tierlift.checkpoint.full_state_dict(tmp_path / "ck")
    assert sorted(got) == ["bf16", "f32", "i64", "nested.t", "u8"]
    for k, v in got.items():
        want = state["nested"]["t"] if k == "nested.t" else state[k]
        assert v.dtype == want.dtype and torch.equal(v, want), k
