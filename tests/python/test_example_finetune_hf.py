"""examples/finetune_hf.py: Hugging Face's Trainer (and Accelerate) with tierlift's AdamW.

Per step, the losses of a Trainer run with tierlift's AdamW (offload none, cpu, nvme) are those
of the same run with torch.optim.AdamW, and the final weights agree within test_optim's
tolerance; a run resumed in a new process from Trainer's mid-run checkpoint (optimizer.pt made
by tierlift's state_dict(), put back into the NVMe tier by load_state_dict()) repeats the
uninterrupted run's losses bit for bit.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="needs Hugging Face transformers "
                    "(pip install transformers accelerate; scripts/setup.sh installs them)")
pytest.importorskip("accelerate", reason="needs Hugging Face accelerate (Trainer uses it)")
from safetensors.torch import load_file  # noqa: E402  (a dependency of transformers)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "finetune_hf.py"
STEPS = 6
TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "32", "--batch-size",
        "4", "--modules", "json,textwrap", "--steps", str(STEPS), "--save-every", str(STEPS // 2)]


def _load_example():
    spec = importlib.util.spec_from_file_location("finetune_hf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return _load_example()


def run(example, out: Path, *flags) -> tuple[dict, dict]:
    """({step: loss}, final weights) of an in-process run writing to `out`."""
    losses = example.main([*TINY, *flags, "--output-dir", str(out)])
    weights = load_file(out / f"checkpoint-{STEPS}" / "model.safetensors")
    return losses, weights


@pytest.fixture(scope="module")
def torch_run(example, tmp_path_factory):
    return run(example, tmp_path_factory.mktemp("torch"), "--optimizer", "torch")


@pytest.fixture(scope="module")
def nvme_run(example, tmp_path_factory):
    """The tierlift run with offload="nvme" (its state files under nvme/): losses, weights and
    its output directory (checkpoint-3, checkpoint-6), which the resume test starts from."""
    root = tmp_path_factory.mktemp("nvme")
    (root / "nvme").mkdir()
    losses, weights = run(example, root / "out", "--offload", "nvme", "--nvme-path",
                          str(root / "nvme"))
    return losses, weights, root


def assert_close_rel(actual, expected):
    """test_optim's tolerance: relative 1e-6, absolute 1e-6 of the tensor's scale."""
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * max(scale, 1.0))


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_trainer_with_tierlift_adamw_matches_torch_adamw(offload, example, torch_run, nvme_run,
                                                         tmp_path):
    if offload == "nvme":
        losses, weights, root = nvme_run
        left = [p.name for p in (root / "nvme").iterdir()]
        assert not left, f"the optimizer's state files outlived close(): {left}"
    else:
        losses, weights = run(example, tmp_path, "--offload", offload)
    ref_losses, ref_weights = torch_run
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert_close_rel(torch.tensor([losses[s] for s in sorted(ref_losses)]),
                     torch.tensor([ref_losses[s] for s in sorted(ref_losses)]))
    assert losses[STEPS] < losses[1] - 0.1  # it learns
    assert weights.keys() == ref_weights.keys()
    for k, v in ref_weights.items():
        assert_close_rel(weights[k], v)


def test_resume_in_a_new_process_repeats_the_uninterrupted_run(nvme_run, tmp_path):
    """Exact, not just close: the resumed process starts from the bytes the first one saved
    (weights in model.safetensors, fp32 optimizer state in optimizer.pt, the lr scheduler, the
    RNG states) and Trainer skips the batches it already used of the same seeded order; the CPU
    kernels are deterministic for a given thread count, which the new process inherits."""
    straight, _, root = nvme_run
    out = tmp_path / "out"
    shutil.copytree(root / "out" / f"checkpoint-{STEPS // 2}", out / f"checkpoint-{STEPS // 2}")
    (tmp_path / "nvme").mkdir()  # a fresh tier: the state comes from optimizer.pt only
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--offload", "nvme",
                           "--nvme-path", str(tmp_path / "nvme"), "--output-dir", str(out),
                           "--resume"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    resumed = {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}
    assert resumed == straight
    for k, v in load_file(root / "out" / f"checkpoint-{STEPS}" / "model.safetensors").items():
        assert torch.equal(load_file(out / f"checkpoint-{STEPS}" / "model.safetensors")[k], v), k


def test_accelerate_prepare_with_tierlift_adamw(example):
    """accelerator.prepare(model, optimizer) wraps tierlift's AdamW (offload="cpu") like any torch
    optimizer; the steps are those of torch.optim.AdamW prepared the same way."""
    from accelerate import Accelerator

    runs = {}
    for name, flags in (("torch", ["--optimizer", "torch"]), ("tierlift", ["--offload", "cpu"])):
        args = example.parse_args([*TINY, *flags])
        model = example.build_model(args)
        accelerator = Accelerator(cpu=True)
        model, opt = accelerator.prepare(model, example.make_optimizer(model, args, None))
        blocks = example.ByteBlocks(example.docstring_bytes(args.modules), args.seq_len).blocks
        losses = []
        for i in range(3):
            x = blocks[4 * i:4 * i + 4]
            loss = model(input_ids=x, labels=x).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[name] = torch.tensor(losses), model.state_dict(), opt
    assert type(runs["tierlift"][2].optimizer).__module__ == "tierlift.optim.adam"
    assert_close_rel(runs["tierlift"][0], runs["torch"][0])
    for k, v in runs["torch"][1].items():
        assert_close_rel(runs["tierlift"][1][k], v)


def test_bad_flags_are_refused(example):
    with pytest.raises(SystemExit):
        example.parse_args(["--optimizer", "torch", "--offload", "nvme"])
    with pytest.raises(SystemExit):
        example.parse_args(["--resume"])  # without --output-dir
