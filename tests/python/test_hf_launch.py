"""tierlift.hf.launch: unmodified stock scripts train sharded; tierlift.hf.from_pretrained loads a
checkpoint straight into shards.

One torchrun launch on 2 gloo ranks (`-m tierlift.hf.launch --config zero.json`, ZeRO-3 with
parameter offload, hf_launch_cases.py) runs a run_clm.py-shaped script (hf_stock_clm.py) and
resumes it from its step-3 checkpoint, a TRL-shaped SFT script (hf_stock_sft.py, when TRL is
installed) and an Accelerate loop (hf_stock_accelerate.py). Each equals the same script run
plainly in this process with the global batch (losses, and global gradient norms where logged,
within 1e-5), the resumed run repeats steps 4-6 bit for bit, and the saved models give the plain
runs' logits. The models come from the scripts' own from_pretrained, loaded partitioned: the
Trainer keeps its weight-decay groups, and the peak RSS growth per rank while loading stays
under 0.6x the model (plain from_pretrained: 1x). The config file's checks, the launcher's
arguments, install / uninstall and the meta-model refusal run in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (scripts/setup.sh installs it)")
pytest.importorskip("accelerate", reason="needs accelerate (scripts/setup.sh installs it)")

import hf_launch_cases as C  # noqa: E402
import hf_worker as W  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ZERO = {"stage": 3, "offload_params": "cpu", "shard_kwargs": {"prefetch": 1}}
BIG = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
           num_key_value_heads=8, intermediate_size=1376, max_position_embeddings=64,
           tie_word_embeddings=False)  # 67 MB in fp32


def _tokenizer(folder: str) -> None:
    """A word-level tokenizer over the tiny vocabulary (TRL loads one with the model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, W.VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                            eos_token="<eos>").save_pretrained(folder)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    W.quiet()
    root = str(tmp_path_factory.mktemp("launch"))
    W.build("llama").save_pretrained(os.path.join(root, "llama"))
    _tokenizer(os.path.join(root, "llama"))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**BIG)).save_pretrained(os.path.join(root, "big"))
    with open(os.path.join(root, "zero.json"), "w") as f:
        json.dump(ZERO, f)
    env = dict(os.environ, OMP_NUM_THREADS="1", TIERLIFT_NUM_THREADS="1",
               MALLOC_MMAP_THRESHOLD_="131072",  # big frees leave the RSS at once
               PYTHONPATH=os.pathsep.join([os.path.join(HERE, "..", "..", "python"), HERE,
                                           os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "tierlift.hf.launch", "--config", os.path.join(root, "zero.json"),
           os.path.join(HERE, "hf_launch_cases.py"), root]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    result = os.path.join(root, "launch.pt")
    assert proc.returncode == 0 and os.path.exists(result), \
        f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return root, torch.load(result, weights_only=False)


def _history(folder: str) -> dict:
    with open(os.path.join(folder, "trainer_state.json")) as f:
        logs = [e for e in json.load(f)["log_history"] if "loss" in e]
    return {"loss": {e["step"]: e["loss"] for e in logs},
            "grad_norm": {e["step"]: e["grad_norm"] for e in logs}}


def _plain(script: str, args: list[str]) -> dict:
    """The script run plainly in this process (no route), one rank taking the global batch."""
    from tierlift.hf import route

    torch.set_num_threads(1)
    route.run_script(script, args)
    return _history(args[args.index("--output_dir") + 1])


def _logits(folder: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder)(input_ids=W.PROBE).logits


@pytest.fixture(scope="module")
def plain_clm(launched, tmp_path_factory):
    root, _ = launched
    out = str(tmp_path_factory.mktemp("plain_clm"))
    return _plain(C.CLM, C.clm_args(os.path.join(root, "llama"), out, 2 * C.PER_RANK)), out


def _close(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b) == list(range(1, C.STEPS + 1))
    torch.testing.assert_close(torch.tensor([a[k] for k in sorted(a)]),
                               torch.tensor([b[k] for k in sorted(b)]), rtol=1e-5, atol=0)


def test_stock_script_equals_one_process(launched, plain_clm):
    root, _ = launched
    ref, ref_out = plain_clm
    got = _history(os.path.join(root, "clm"))
    _close(got["loss"], ref["loss"])
    _close(got["grad_norm"], ref["grad_norm"])
    assert min(ref["grad_norm"].values()) > 0.5  # every step was clipped (global norm)
    # save_model wrote the full model: from_pretrained gives the plain run's logits.
    torch.testing.assert_close(_logits(os.path.join(root, "clm")), _logits(ref_out),
                               rtol=1e-4, atol=1e-4)


def test_stock_script_resumes_bit_for_bit(launched):
    root, _ = launched
    first = _history(os.path.join(root, "clm"))
    resumed = _history(os.path.join(root, "resume"))
    assert sorted(resumed["loss"]) == list(range(1, C.STEPS + 1))
    for step in range(C.SAVE_AT + 1, C.STEPS + 1):
        assert resumed["loss"][step] == first["loss"][step], step
        assert resumed["grad_norm"][step] == first["grad_norm"][step], step


def test_trl_sft_script_equals_one_process(launched, tmp_path):
    pytest.importorskip("trl", reason="needs trl (pip install trl)")
    root, _ = launched
    ref = _plain(C.SFT, C.sft_args(os.path.join(root, "llama"), str(tmp_path), 2 * C.PER_RANK))
    got = _history(os.path.join(root, "sft"))
    _close(got["loss"], ref["loss"])
    _close(got["grad_norm"], ref["grad_norm"])


def test_accelerate_script_equals_one_process(launched, tmp_path):
    from safetensors.torch import load_file

    root, _ = launched
    C.run_accelerate(os.path.join(root, "llama"), str(tmp_path), 2 * C.PER_RANK)
    with open(tmp_path / "losses.json") as f:
        ref = json.load(f)
    with open(os.path.join(root, "accelerate", "losses.json")) as f:
        got = json.load(f)
    assert sorted(got) == sorted(ref) and len(ref) == 4
    torch.testing.assert_close(torch.tensor([got[k] for k in sorted(got)]),
                               torch.tensor([ref[k] for k in sorted(ref)]), rtol=1e-5, atol=0)
    # accelerator.save_model writes the weights only: into the model class, then compared.
    logits = []
    for folder in (os.path.join(root, "accelerate"), str(tmp_path)):
        model = W.build("llama")
        model.load_state_dict(load_file(os.path.join(folder, "model.safetensors")))
        with torch.no_grad():
            logits.append(model(input_ids=W.PROBE).logits)
    torch.testing.assert_close(*logits, rtol=1e-4, atol=1e-4)


def test_partitioned_model_keeps_the_decay_split(launched):
    from transformers import Trainer

    _, res = launched
    r = res["trainer"]
    assert r["is_tierlift_trainer"] and r["sharded"]
    assert r["accelerator"] == "tierlift.hf.accelerator"
    model = W.build("llama")
    decay = set(Trainer.get_decay_parameter_names(None, model))
    n_decay = sum(p.numel() for n, p in model.named_parameters() if n in decay)
    n_rest = sum(p.numel() for n, p in model.named_parameters() if n not in decay)
    assert n_decay and n_rest
    groups = dict(r["groups"])
    assert sorted(groups) == [0.0, 0.1]
    # this rank's half of each side (each unit's flat shard padded to an even size)
    assert n_decay // 2 <= groups[0.1] <= n_decay // 2 + 16
    assert n_rest // 2 <= groups[0.0] <= n_rest // 2 + 16
    assert r["zero_refused"].startswith("TypeError: under tierlift.hf.launch the ZeroConfig")


def test_partitioned_load_peak_rss(launched):
    """Each rank holds its shards (half the model) plus one read while loading; plain
    from_pretrained holds the whole model, which shows the probe sees a whole load."""
    _, res = launched
    for rank in res["rss"]:
        total = rank["model"]
        assert rank["shards"] <= 0.51 * total
        assert rank["partitioned"] <= 0.6 * total, rank
        assert rank["plain"] >= 0.9 * total, rank


# ---- in this process -------------------------------------------------------------------------

def test_config_file_is_typed(tmp_path):
    from tierlift.hf import ZeroConfig, load_config
    from tierlift.hf.config_file import parse_config

    path = tmp_path / "zero.json"
    path.write_text(json.dumps({"stage": 3, "offload_params": "cpu",
                                "mixed_precision": {"param_dtype": "bf16"},
                                "optimizer_kwargs": {"offload": "cpu"},
                                "from_pretrained": "whole"}))
    cfg = load_config(path)
    assert cfg.zero == ZeroConfig(stage=3, offload_params="cpu",
                                  mixed_precision=tierlift_mp(torch.bfloat16),
                                  optimizer_kwargs={"offload": "cpu"})
    assert cfg.from_pretrained == "whole"
    assert parse_config({}).zero == ZeroConfig()
    cases = [
        ({"stag": 3}, ValueError, "unknown key 'stag'"),
        ({"stage": "3"}, TypeError, "'stage' must be int, got str"),
        ({"stage": True}, TypeError, "'stage' must be int, got bool"),
        ({"background_saves": 1}, TypeError, "'background_saves' must be bool"),
        ({"staging_budget": 1.5}, TypeError, "'staging_budget' must be int or null"),
        ({"mixed_precision": {"param_dtyp": "bf16"}}, ValueError, "unknown key 'param_dtyp'"),
        ({"mixed_precision": {"param_dtype": "bf8"}}, ValueError, "param_dtype must be one of"),
        ({"shard_kwargs": {"prefech": 2}}, ValueError, "unknown key 'prefech'"),
        ({"stage": 2, "offload_params": "cpu"}, ValueError, "needs stage=3"),
        ({"from_pretrained": "sharded"}, ValueError, "from_pretrained must be one of"),
        ([3], TypeError, "must hold an object"),
    ]
    for data, exc, message in cases:
        with pytest.raises(exc, match=message):
            parse_config(data, "zero.json")
    path.write_text('{"stage": 3,}')
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_config(path)


def tierlift_mp(dtype):
    from tierlift.zero import MixedPrecision

    return MixedPrecision(param_dtype=dtype)


def test_yaml_config(tmp_path):
    pytest.importorskip("yaml")
    from tierlift.hf import load_config

    (tmp_path / "zero.yaml").write_text("stage: 2\noptimizer_kwargs:\n  state_dtype: bf16\n")
    cfg = load_config(tmp_path / "zero.yaml")
    assert cfg.zero.stage == 2 and cfg.zero.optimizer_kwargs == {"state_dtype": torch.bfloat16}


def test_launcher_arguments():
    from tierlift.hf.route import parse_argv

    assert parse_argv(["--config", "z.json", "run.py", "--config", "x"], {}) == \
        ("z.json", "run.py", False, ["--config", "x"])  # the script's own --config is its own
    assert parse_argv(["--config=z.json", "-m", "trl.scripts.sft", "--lr", "1"], {}) == \
        ("z.json", "trl.scripts.sft", True, ["--lr", "1"])
    assert parse_argv(["run.py"], {"TIERLIFT_HF_CONFIG": "env.json"}) == \
        ("env.json", "run.py", False, [])
    for argv in (["run.py"], ["--config", "z.json"], ["--config"], ["--confi", "z", "r.py"]):
        with pytest.raises(SystemExit):
            parse_argv(argv, {})


def test_run_script_as_module(tmp_path):
    """`-m MODULE`: run as `python -m MODULE ARGS` would (json.tool copies its input)."""
    import sys as _sys

    from tierlift.hf.route import run_script

    (tmp_path / "in.json").write_text('{"b": 1, "a": [2]}')
    argv = list(_sys.argv)
    run_script("json.tool", ["--sort-keys", str(tmp_path / "in.json"), str(tmp_path / "out.json")],
               module=True)
    assert json.loads((tmp_path / "out.json").read_text()) == {"a": [2], "b": 1}
    assert _sys.argv == argv


def test_install_and_uninstall():
    import accelerate
    import transformers.trainer
    from transformers import PreTrainedModel

    import tierlift.hf
    from tierlift.hf import route
    from tierlift.hf.config_file import parse_config

    def top():  # what a script importing transformers now gets
        return sys.modules["transformers"]

    before = (top().Trainer, accelerate.Accelerator, PreTrainedModel.from_pretrained)
    route.install(parse_config({"stage": 2}))
    try:
        assert issubclass(top().Trainer, tierlift.hf.Trainer)
        assert transformers.trainer.Trainer is top().Trainer
        assert accelerate.Accelerator is tierlift.hf.Accelerator
        with pytest.raises(RuntimeError, match="installed already"):
            route.install(parse_config({}))
    finally:
        route.uninstall()
    assert (top().Trainer, accelerate.Accelerator, PreTrainedModel.from_pretrained) == before
    route.install(parse_config({"from_pretrained": "whole"}))
    try:  # the Trainer shards what from_pretrained loads whole
        assert PreTrainedModel.from_pretrained == before[2]
        assert issubclass(top().Trainer, tierlift.hf.Trainer)
    finally:
        route.uninstall()
    assert "from_pretrained" not in {n for _, n in route._SAVED}


def test_trainer_refuses_a_meta_model(tmp_path):
    from accelerate import init_empty_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    import tierlift.hf

    with init_empty_weights():
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=64))
    args = W.training_args(str(tmp_path), batch=2)
    with pytest.raises(ValueError, match=r"meta device: load the model with tierlift.hf.from_p"):
        tierlift.hf.Trainer(model=model, args=args, zero=tierlift.hf.ZeroConfig(stage=3))
