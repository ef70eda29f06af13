"""tierlift.checkpoint hand-off (handoff.py): `export --format hf` writes safetensors shards and
an index that transformers' from_pretrained loads bit for bit (and one model.safetensors when
the model fits in a shard); `import-dcp` turns a torch.distributed.checkpoint into a tierlift
checkpoint that load() takes; bad input fails with a message and leaves nothing behind."""

import json
import os

import pytest
import torch
from torch import nn

import tierlift
from tierlift.checkpoint.__main__ import main

transformers = pytest.importorskip("transformers", reason="needs Hugging Face transformers "
                                   "(pip install transformers)")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors "
                                        "(pip install safetensors)")
# dcp.save without a process group (a single process) says so; that is what these tests do.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def llama(tie: bool, seed: int = 0):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def saved(tmp_path, tie: bool):
    """A Llama saved by tierlift.checkpoint.save, and its config.json."""
    model = llama(tie)
    ckpt, config = tmp_path / "ckpt", tmp_path / "config.json"
    tierlift.checkpoint.save(ckpt, model)
    model.config.to_json_file(config)
    return model, str(ckpt), str(config)


def assert_same(model, out_dir):
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(out_dir,
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ref, got = model.state_dict(), loaded.eval().state_dict()
    assert list(got) == list(ref)
    for name, value in ref.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    return loaded


def test_export_hf_sharded(tmp_path):
    model, ckpt, config = saved(tmp_path, tie=False)
    out = tmp_path / "hf"
    assert main(["export", ckpt, str(out), "--format", "hf", "--max-shard-size", "100KB",
                 "--config", config]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                     for i in range(1, len(files) + 1)]
    assert sorted(os.listdir(out)) == sorted([*files, "config.json",
                                              "model.safetensors.index.json"])
    ref = model.state_dict()
    assert list(index["weight_map"]) == list(ref)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size()
                                                  for v in ref.values())
    seen = {}
    for file in files:
        shard = safetensors_torch.load_file(out / file)
        assert sum(v.numel() * v.element_size() for v in shard.values()) <= 100_000 or \
            len(shard) == 1
        for name, value in shard.items():
            assert index["weight_map"][name] == file
            seen[name] = value
    assert seen.keys() == ref.keys()
    assert all(torch.equal(seen[k], v) for k, v in ref.items())
    assert_same(model, str(out))
    assert not os.path.exists(str(out) + ".tmp")


def test_export_hf_single_file_tied(tmp_path):
    model, ckpt, config = saved(tmp_path, tie=True)
    out = tmp_path / "hf"
    out.mkdir()  # an empty directory is fine
    assert main(["export", ckpt, str(out), "--format", "hf", "--config", config]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    shard = safetensors_torch.load_file(out / "model.safetensors")
    assert sorted(shard) == sorted(model.state_dict())  # the tied alias is written as well
    loaded = assert_same(model, str(out))
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_export_hf_of_a_compiled_model_has_the_model_names(tmp_path):
    model = llama(tie=False)
    ckpt, config = tmp_path / "ckpt", tmp_path / "config.json"
    tierlift.checkpoint.save(ckpt, torch.compile(model))  # saved as _orig_mod.<name>
    model.config.to_json_file(config)
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), str(out), "--format", "hf", "--config", str(config)]) == 0
    assert_same(model, str(out))


def test_export_hf_refuses_names_that_meet_without_wrappers(tmp_path, capsys):
    class Both(nn.Module):  # 'weight' and 'module.weight' are one name without DDP's prefix
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(2))
            self.module = nn.Linear(2, 2, bias=False)

    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    tierlift.checkpoint.save(ckpt, Both())
    with pytest.raises(SystemExit):
        main(["export", str(ckpt), str(out), "--format", "hf"])
    assert "'module.weight' and 'weight' both name 'weight'" in capsys.readouterr().err
    assert not os.path.exists(out) and not os.path.exists(str(out) + ".tmp")


def small():
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


@pytest.mark.parametrize("prefix", ["", "model."])
def test_import_dcp(tmp_path, prefix):
    import torch.distributed.checkpoint as dcp

    model = small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    state = ({"model": model.state_dict(), "optim": opt.state_dict()} if prefix
             else model.state_dict())
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    args = ["import-dcp", str(tmp_path / "dcp"), str(tmp_path / "ckpt")]
    assert main(args + (["--prefix", prefix] if prefix else [])) == 0
    fresh = small()
    tierlift.checkpoint.load(tmp_path / "ckpt", fresh)  # strict: every key, right shapes
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def fails(args, capsys, match):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code != 0
    assert match in capsys.readouterr().err


def test_bad_input(tmp_path, capsys):
    _, ckpt, _ = saved(tmp_path, tie=False)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    fails(["export", ckpt, str(busy), "--format", "hf"], capsys, "not an empty directory")
    assert os.listdir(busy) == ["keep.txt"]
    out = tmp_path / "hf"
    fails(["export", str(tmp_path / "nope"), str(out), "--format", "hf"], capsys,
          "is not a tierlift checkpoint")
    fails(["export", ckpt, str(out), "--format", "hf", "--max-shard-size", "5XB"], capsys,
          "bad shard size '5XB'")
    fails(["export", ckpt, str(out), "--format", "hf", "--max-shard-size", "0"], capsys,
          "more than 0 bytes")
    fails(["export", ckpt, str(out), "--format", "hf", "--config", str(tmp_path / "nope.json")],
          capsys, "does not exist")
    fails(["export", ckpt, str(tmp_path / "m.pt"), "--max-shard-size", "1GB"], capsys,
          "go with --format hf")
    fails(["import-dcp", str(tmp_path / "nope"), str(tmp_path / "c2")], capsys, "does not exist")
    fails(["import-dcp", ckpt, str(tmp_path / "c2")], capsys,
          "is not a torch.distributed.checkpoint directory")
    import torch.distributed.checkpoint as dcp

    dcp.save(small().state_dict(), checkpoint_id=str(tmp_path / "dcp"))
    fails(["import-dcp", str(tmp_path / "dcp"), str(tmp_path / "c2"), "--prefix", "model."],
          capsys, "no tensors whose names start with 'model.'")
    left = sorted(os.listdir(tmp_path))
    assert left == ["busy", "ckpt", "config.json", "dcp"], left
