"""shard() of models built on the meta device, on 2 gloo ranks: deferred_init() replays the
construction bit for bit (the examples' GPT-2 and Llama, Hugging Face Llama and GPT-2, the test
GPT with a frozen parameter and a tied head), weights= streams safetensors (one file, tierlift's
sharded HF export, save_pretrained) equal to load_full_state_dict, Hugging Face models give the
one-process logits, peak RSS per rank stays near the rank's shards, hierarchical sharding
reads each node's slices, and every case shard() cannot fill is refused before anything
changes.

One spawn runs every case (process start-up dominates on a 2-core machine)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from zero_model import batches, free_port, init_gloo, make_model, shutdown, train

import tierlift
from tierlift.zero.weight_files import WeightFiles

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from gpt_model import GPT, GPTConfig  # noqa: E402
from llama_model import Llama, LlamaConfig  # noqa: E402

transformers = pytest.importorskip("transformers", reason="needs Hugging Face transformers")
pytest.importorskip("accelerate", reason="needs Hugging Face accelerate")
from safetensors.torch import save_file  # noqa: E402

LLAMA = LlamaConfig(vocab_size=61, dim=32, n_layer=3, n_head=4, n_kv_head=2, ffn_dim=44,
                    max_seq_len=16)
GPT_CFG = GPTConfig(vocab_size=61, seq_len=16, n_layer=3, n_head=2, dim=24)
OPT = dict(lr=3e-3, weight_decay=0.1)
WEIGHT_CASES = {  # name: (model, weights, stage, other shard() arguments)
    "llama-3": ("llama", "llama", 3, {}),
    "gpt-3": ("gpt", "gpt-export", 3, {}),
    "llama-2": ("llama", "llama", 2, {}),
    "llama-3-offload": ("llama", "llama", 3, {"offload_params": "cpu", "device_params": 3000}),
    "llama-3-nvme": ("llama", "llama", 3, {"offload_params": "nvme", "nvme_path": "NVME"}),
    "llama-3-bf16": ("llama", "llama", 3,
                     {"mixed_precision": tierlift.zero.MixedPrecision(param_dtype=torch.bfloat16)}),
    "gpt-3-groups": ("gpt", "gpt-export", 3,
                     {"param_group_fn": lambda n, p: "decay" if p.dim() >= 2 else "no_decay"}),
}


def _hf(kind: str):
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=44,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=32)
        return transformers.LlamaForCausalLM, cfg
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel, cfg


class DataBuffers(torch.nn.Module):
    """Buffers made from data and edited in place while the model is built: the replay must not
    apply those edits a second time."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.register_buffer("scale", torch.tensor([1.0, 2.0]))
        self.scale.mul_(2)
        self.register_buffer("steps", torch.arange(3.0) * torch.tensor(2.0))  # meta x CPU

    def forward(self, x):
        return self.lin(x)


def _builders():
    return {"gpt": lambda: GPT(GPT_CFG), "llama": lambda: Llama(LLAMA), "tiny": make_model,
            "data": DataBuffers,
            "hf-llama": lambda: _hf("llama")[0](_hf("llama")[1]),
            "hf-gpt2": lambda: _hf("gpt2")[0](_hf("gpt2")[1])}


def _deferred(name: str, seed: int = 0):
    with tierlift.zero.deferred_init():
        torch.manual_seed(seed)
        return _builders()[name]()


def _eager(name: str, seed: int = 0):
    torch.manual_seed(seed)
    return _builders()[name]()


def _shards(model) -> list[torch.Tensor]:
    return [u.shard.detach().clone() for u in model._tierlift_zero.units]


def _refusal(fn) -> str:
    try:
        fn()
    except (ValueError, KeyError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _worker(rank, world, port, files, out):
    init_gloo(rank, world, port)
    from accelerate import init_empty_weights

    res: dict = {}
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(5))
    # deferred_init() == eager construction: full_state_dict, generator state after, logits.
    for name, stage in [("gpt", 3), ("llama", 3), ("llama", 2), ("tiny", 3), ("tiny", 1),
                        ("data", 3), ("hf-llama", 3), ("hf-gpt2", 3)]:
        eager = _eager(name)
        after_eager = torch.rand(4)
        model = tierlift.zero.shard(_deferred(name), stage=stage, device="cpu")
        after = torch.rand(4)
        sd = tierlift.zero.full_state_dict(model)
        ref = eager.state_dict()
        bufs = dict(model.named_buffers())
        res[f"deferred-{name}-{stage}"] = {
            "buffers": [n for n, b in eager.named_buffers() if not torch.equal(b, bufs[n])],
            "keys": list(sd) == list(ref),
            "equal": [k for k in ref if not torch.equal(sd[k], ref[k])],
            "rng": torch.equal(after, after_eager),
            "meta": [n for n, t in [*model.named_parameters(), *model.named_buffers()]
                     if t.is_meta],
            "recording_dropped": tierlift.zero.deferred.recording_of(model) is None}
    # Training from a deferred model: the same losses as from the eager one, bit for bit.
    losses = {}
    for how in ("eager", "deferred"):
        model = _eager("tiny") if how == "eager" else _deferred("tiny")
        kw = {} if how == "eager" else {"device": "cpu"}
        model = tierlift.zero.shard(model, stage=3, **kw)
        opt = torch.optim.AdamW(model.parameters(), **OPT)
        losses[how] = train(model, opt, batches(3, 4), accum=1, clip=0.5, world=world,
                            rank=rank, zero=True)
    res["losses"] = losses
    # weights=: this rank's byte ranges, equal to load_full_state_dict of the same tensors.
    for case, (name, path, stage, kw) in WEIGHT_CASES.items():
        path = files[path]
        kw = {k: files["nvme"] if v == "NVME" else v for k, v in kw.items()}
        loaded = tierlift.zero.shard(_eager(name, seed=9), stage=stage, **kw)
        sd = {k: v for k, v in files["sd-" + name].items()}
        tierlift.zero.load_full_state_dict(loaded, sd)
        streamed = _deferred(name, seed=9)
        before = torch.get_rng_state()  # rotary tables replay without the random ops
        streamed = tierlift.zero.shard(streamed, stage=stage, device="cpu", weights=path, **kw)
        res[f"weights-{case}"] = {
            "shards": all(torch.equal(a, b) for a, b in zip(_shards(loaded), _shards(streamed),
                                                              strict=True)),
            "full": all(torch.equal(v, sd[k]) for k, v in
                        tierlift.zero.full_state_dict(streamed).items() if k in sd),
            "logits": torch.equal(loaded(idx), streamed(idx)),
            "rng_untouched": torch.equal(before, torch.get_rng_state())}
    # Hugging Face models from save_pretrained: logits of the one-process model.
    hf_idx = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(6))
    for kind in ("llama", "gpt2"):
        cls, cfg = _hf(kind)
        for how in ("init_empty_weights", "deferred_init"):
            if how == "init_empty_weights":
                with init_empty_weights():
                    model = cls(cfg)
                model.tie_weights()  # init_empty_weights unties them
            else:
                with tierlift.zero.deferred_init():
                    model = cls(cfg)
            model = tierlift.zero.shard(model.eval(), stage=3, device="cpu",
                                        weights=files[f"hf-{kind}"])
            with torch.no_grad():
                res[f"hf-{kind}-{how}"] = model(hf_idx).logits
    # Refusals, each before anything changes (the model shards fine afterwards).
    with torch.device("meta"):
        bare = Llama(LLAMA)
    res["refuse-no-source"] = _refusal(lambda: tierlift.zero.shard(bare, device="cpu"))
    res["refuse-no-device"] = _refusal(lambda: tierlift.zero.shard(_deferred("llama")))
    res["refuse-real-model"] = _refusal(lambda: tierlift.zero.shard(_eager("llama"),
                                                                    device="cpu"))
    res["refuse-meta-buffer"] = _refusal(
        lambda: tierlift.zero.shard(bare, device="cpu", weights=files["llama"]))
    res["bare-untouched"] = all(t.is_meta for t in bare.state_dict().values())
    mixed = _eager("llama")
    mixed.rope_cos = mixed.rope_cos.to("meta")  # one buffer left on meta
    res["refuse-mixed"] = _refusal(lambda: tierlift.zero.shard(mixed))
    res["refuse-mixed-device"] = _refusal(lambda: tierlift.zero.shard(mixed, device="cpu"))
    res["refuse-missing"] = _refusal(lambda: tierlift.zero.shard(
        _deferred("llama"), device="cpu", weights=files["llama-missing"]))
    gpt = _deferred("gpt")
    res["refuse-other-model"] = _refusal(lambda: tierlift.zero.shard(gpt, device="cpu",
                                                                     weights=files["llama"]))
    res["refuse-shape"] = _refusal(lambda: tierlift.zero.shard(_deferred("llama"), device="cpu",
                                                               weights=files["llama-wide"]))
    res["refuse-extra"] = _refusal(lambda: tierlift.zero.shard(_deferred("llama"), device="cpu",
                                                               weights=files["llama-extra"]))
    res["retry-after-refusal"] = torch.equal(
        tierlift.zero.full_state_dict(tierlift.zero.shard(gpt, device="cpu",
                                                          weights=files["gpt-export"]))
        ["tok.weight"], files["sd-gpt"]["tok.weight"])
    edited = _deferred("llama")
    with torch.no_grad():
        edited.head.weight.zero_()  # on meta, outside the block: not recorded
    res["refuse-edited-after"] = _refusal(lambda: tierlift.zero.shard(edited, device="cpu"))
    tied = _deferred("llama")
    tied.head.weight = tied.tok.weight  # re-assigning attributes is fine
    res["tied-after"] = torch.equal(
        tierlift.zero.full_state_dict(tierlift.zero.shard(tied, device="cpu"))["head.weight"],
        _eager("llama").tok.weight)
    res["refuse-load-unsharded"] = _refusal(
        lambda: tierlift.zero.load_full_state_dict(_deferred("llama"), files["sd-llama"]))
    res["rss"] = _peak_rss(files["rss"])
    torch.save(res, out.replace(".pt", f"{rank}.pt"))
    shutdown()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tierlift.checkpoint.handoff import export_hf

    root = tmp_path_factory.mktemp("weights")
    out = {"nvme": str(tmp_path_factory.mktemp("nvme"))}
    llama = _eager("llama", seed=4)
    sd = {k: v.contiguous() for k, v in llama.state_dict().items()}
    (root / "llama").mkdir()
    save_file(sd, root / "llama" / "model.safetensors")
    out["llama"], out["sd-llama"] = str(root / "llama"), sd
    wide = dict(sd, **{"norm.weight": torch.ones(LLAMA.dim + 1)})
    (root / "llama-wide").mkdir()
    save_file(wide, root / "llama-wide" / "model.safetensors")
    (root / "llama-extra").mkdir()
    save_file(dict(sd, stray=torch.zeros(2)), root / "llama-extra" / "model.safetensors")
    (root / "llama-missing").mkdir()
    save_file({k: v for k, v in sd.items() if k != "head.weight"},
              root / "llama-missing" / "model.safetensors")
    for name in ("llama-wide", "llama-extra", "llama-missing"):
        out[name] = str(root / name)
    gpt = _eager("gpt", seed=4)  # tied head: tierlift's export writes it under both names
    tierlift.checkpoint.save(str(root / "gpt-ckpt"), gpt)
    export_hf(str(root / "gpt-ckpt"), str(root / "gpt-export"), max_shard_size=20_000)
    out["gpt-export"], out["sd-gpt"] = str(root / "gpt-export"), gpt.state_dict()
    for kind in ("llama", "gpt2"):
        torch.manual_seed(3)
        cls, cfg = _hf(kind)
        model = cls(cfg).eval()
        model.save_pretrained(root / f"hf-{kind}")
        hf_idx = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            out[f"hf-{kind}-logits"] = model(hf_idx).logits
        out[f"hf-{kind}"] = str(root / f"hf-{kind}")
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**RSS_CFG))
    (root / "rss").mkdir()
    save_file(model.state_dict(), root / "rss" / "model.safetensors")
    out["rss"] = str(root / "rss")
    return out


@pytest.fixture(scope="module")
def world2(files, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("meta") / "res.pt")
    # glibc: every allocation of 128 KiB or more is its own mapping, so freed buffers leave the
    # RSS at once (the peak RSS measurement does not depend on heap trimming).
    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    try:
        mp.spawn(_worker, args=(2, free_port(), files, out), nprocs=2)
    finally:
        if old is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old
    return [torch.load(out.replace(".pt", f"{r}.pt"), weights_only=True) for r in range(2)]


@pytest.mark.parametrize("case", ["gpt-3", "llama-3", "llama-2", "tiny-3", "tiny-1", "data-3",
                                  "hf-llama-3", "hf-gpt2-3"])
def test_deferred_equals_eager(world2, case):
    for res in world2:
        r = res[f"deferred-{case}"]
        assert r["keys"] and r["equal"] == [] and r["meta"] == [] and r["recording_dropped"], r
        assert r["buffers"] == [], r  # non-persistent ones too
        assert r["rng"], "the CPU generator is not where eager construction leaves it"


def test_deferred_trains_as_eager(world2):
    for res in world2:
        assert res["losses"]["deferred"] == res["losses"]["eager"]


def test_sharded_export_has_several_files(files):
    index = json.loads((Path(files["gpt-export"]) / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    assert "head.weight" in index["weight_map"]  # the tied alias, stored again


@pytest.mark.parametrize("case", list(WEIGHT_CASES))
def test_weights_equal_load_full_state_dict(world2, case):
    for res in world2:
        assert res[f"weights-{case}"] == {"shards": True, "full": True, "logits": True,
                                          "rng_untouched": True}


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("how", ["init_empty_weights", "deferred_init"])
def test_hf_from_save_pretrained(world2, files, kind, how):
    for res in world2:
        torch.testing.assert_close(res[f"hf-{kind}-{how}"], files[f"hf-{kind}-logits"],
                                   rtol=1e-6, atol=1e-6)


def test_refusals(world2):
    res = world2[0]
    assert "nothing says what they hold" in res["refuse-no-source"]
    assert "pass device=" in res["refuse-no-device"]
    assert "this model's are on cpu" in res["refuse-real-model"]
    assert "buffer 'rope_cos' is on the meta device" in res["refuse-meta-buffer"]
    assert res["bare-untouched"]
    assert "'rope_cos' is on the meta device: pass device=" in res["refuse-mixed"]
    assert "parameter 'tok.weight' is on cpu while 'rope_cos' is on the meta device" in \
        res["refuse-mixed-device"]
    assert "KeyError" in res["refuse-missing"] and "'head.weight'" in res["refuse-missing"]
    assert "'tok.weight' has shape (61, 32), the model expects (61, 24)" in \
        res["refuse-other-model"]
    assert "'norm.weight' has shape (33,)" in res["refuse-shape"]
    assert "does not have: ['stray']" in res["refuse-extra"]
    assert res["retry-after-refusal"]
    assert "model is not sharded" in res["refuse-load-unsharded"]
    assert "'head.weight' was changed in place after the deferred_init() block" in \
        res["refuse-edited-after"]
    assert res["tied-after"]


def test_truncated_file_is_refused(tmp_path):
    save_file({"w": torch.ones(64, 64)}, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        WeightFiles(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        WeightFiles(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="is not a directory of safetensors"):
        WeightFiles(tmp_path / "missing")


def test_partial_reads(tmp_path):
    w = torch.randn(7, 5).to(torch.bfloat16)
    save_file({"w": w}, tmp_path / "model.safetensors")
    files = WeightFiles(tmp_path)
    assert torch.equal(files.read("w", 3, 17), w.reshape(-1)[3:17])
    assert torch.equal(files.read("w").view(7, 5), w)
    out = torch.zeros(14)
    files.read_into("w", 3, out, chunk=4)  # converted, piece by piece
    assert torch.equal(out, w.reshape(-1)[3:17].float())
    save_file({"v": torch.randn(30)}, tmp_path / "v.safetensors")
    v = WeightFiles(tmp_path / "v.safetensors")
    out = torch.zeros(20)
    v.read_into("v", 10, out, chunk=7)  # straight into `out`
    assert torch.equal(out, v.read("v")[10:])
    with pytest.raises(ValueError, match="cannot read 20 elements from 11 of 30"):
        v.read_into("v", 11, out)


# ---- peak RSS per rank while loading from safetensors ----------------------------------------

RSS_CFG = dict(vocab_size=4096, dim=512, n_layer=4, n_head=8, n_kv_head=8, ffn_dim=1376,
               max_seq_len=64)  # 67 MB in fp32


def _peak_rss(path: str) -> dict:
    """Peak RSS growth of this rank while shard() reads the model from `path`."""
    from accelerate import init_empty_weights

    from tierlift import _peak_rss

    with init_empty_weights():  # parameters on meta, the rotary tables on the CPU
        model = Llama(LlamaConfig(**RSS_CFG))
    growth, model = _peak_rss.growth(
        lambda: tierlift.zero.shard(model, stage=3, device="cpu", weights=path))
    return {"growth": growth,
            "shard": sum(u.shard.numel() * 4 for u in model._tierlift_zero.units)}


def test_peak_rss_while_loading(world2):
    total = LlamaConfig(**RSS_CFG).num_params() * 4
    for res in world2:
        growth, shard = res["rss"]["growth"], res["rss"]["shard"]
        # The rank's shards (half the model) read straight into place, and the process group's
        # few MB; never the whole model (building it eagerly and sharding it takes 1.9x).
        assert shard <= 0.51 * total
        assert growth < shard + 0.1 * total, (growth, shard, total)


# ---- hierarchical sharding: each node's shard group reads its slices -------------------------

HIER = """
import sys
import tierlift
sys.path.insert(0, {examples!r})
from llama_model import Llama, LlamaConfig
cfg = LlamaConfig(**{cfg!r})
def deferred():
    with tierlift.zero.deferred_init():
        torch.manual_seed(0)
        return Llama(cfg)
out = {{}}
for how in ("weights", "replay"):
    model = tierlift.zero.shard(deferred(), stage=3, hierarchy="node", device="cpu",
                                weights={path!r} if how == "weights" else None)
    out[how] = (tierlift.zero.full_state_dict(model), model._tierlift_zero.comm.world)
"""


def test_hierarchy_node_slices(tmp_path):
    from zero_model import run_torchrun

    cfg = dict(vocab_size=61, dim=32, n_layer=2, n_head=4, n_kv_head=2, ffn_dim=44,
               max_seq_len=16)
    torch.manual_seed(4)
    sd = Llama(LlamaConfig(**cfg)).state_dict()
    (tmp_path / "w").mkdir()
    save_file(sd, tmp_path / "w" / "model.safetensors")
    torch.manual_seed(0)
    eager = Llama(LlamaConfig(**cfg)).state_dict()
    out = run_torchrun(HIER, tmp_path, timeout=200, nnodes=2, nproc=2, weights_only=True,
                       examples=str(ROOT / "examples"), cfg=cfg, path=str(tmp_path / "w"))
    for how, ref in (("weights", sd), ("replay", eager)):
        full, shard_world = out[how]
        assert shard_world == 2  # sharded within the node, replicated across the two
        assert all(torch.equal(full[k], ref[k]) for k in ref), how
