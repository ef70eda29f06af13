"""The arithmetic behind the GPU run's numbers, pinned on the CPU: the fine-tune's FLOPs per step
against torch's own FLOP counter over the model the benchmark builds, and its rows' TFLOPS and
tokens/s; the bytes each quantize kernel is credited with against what it returns (bf16 in once,
codes and every scale out); each AdamW GPU contender's bytes per parameter against the tensors
its step touches, and its GB/s."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import tierlift

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "examples")]
import bench_lowp  # noqa: E402
import bench_optim  # noqa: E402
import finetune_sizing as fs  # noqa: E402
import offload_finetune as of  # noqa: E402

del sys.path[:2]

needs_ext = pytest.mark.skipif(not tierlift._extension.available(),
                               reason="compiled extension not loaded")


@pytest.mark.parametrize("seq", [32, 64])
def test_finetune_flops_are_the_models_matmuls(seq):
    """torch's FlopCounterMode over one forward + backward of the tiny Llama: its matmuls are
    exactly 6 x the matmul parameters x tokens (the input embedding, a lookup, does none), and
    its attention forward exactly a third of the formula's 12 L d T per token."""
    cfg, batch = fs.config("tiny", seq), 2
    model = of.build_model("tiny", seq, torch.device("cpu"))
    n = sum(p.numel() for p in model.parameters())
    x = torch.randint(cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(x[:, :-1], x[:, 1:]).backward()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    tokens = batch * seq
    attention = 12 * cfg.n_layer * cfg.dim * seq * tokens
    assert of.flops_per_step(cfg, n, batch, seq) == counts["aten.mm"] + attention
    attention_fwd = sum(v for k, v in counts.items() if "attention" in k and "backward" not in k)
    assert 3 * attention_fwd == attention


def test_finetune_flops_at_the_gpu_runs_sizes():
    """By hand for the 1.1B and 7B rows: 6 x (params - vocab x dim - the norms) + 12 L d T per
    token; counting the embedding table had put 5.6% (1.1B) and 1.8% (7B) on every TFLOPS."""
    for name, batch, params, embedding in (("1b", 8, 1_104_218_112, 32000 * 2048),
                                           ("7b", 4, 6_738_415_616, 32000 * 4096)):
        cfg = fs.config(name, 2048)
        assert cfg.num_params() == params
        norms = (2 * cfg.n_layer + 1) * cfg.dim
        want = (6 * (params - embedding - norms) + 12 * cfg.n_layer * cfg.dim * 2048) * batch * 2048
        assert of.flops_per_step(cfg, params, batch, 2048) == want
    assert of.flops_per_step(fs.config("1b", 2048), 1_104_218_112, 8, 2048) / 1e12 == \
        pytest.approx(115.3, abs=0.05)


# bytes per element of an n x n bf16 input (n = 256 here): 2 read, 1 per FP8 layout written, 4
# per fp32 scale: per tensor, per row (n), per 1x128 block, per 128x128 tile, per column (n);
# dual: both layouts, each with its scales. FP4: half a byte of codes, one scale byte per 32
# (MX) or 16 (NV) values, 4 for the global scale.
N = 256
FP8_SCALES_PER_ELEM = {"tensor": 1 / N**2, "row": 1 / N, "1x128": 1 / 128,
                       "128x128": 1 / 128**2, "col": 1 / N}


def expected_bytes_per_elem(scaling: str, dual: bool) -> float:
    if scaling == "tensor-delayed":  # codes (one layout or both), scale_used and amax
        return 2 + (2 if dual else 1) + 8 / N**2
    if scaling.startswith("fp4-"):
        return 2 + 0.5 + (1 / 16 if scaling == "fp4-nv" else 1 / 32) + 4 / N**2
    return 2 + (2 if dual else 1) * (1 + 4 * FP8_SCALES_PER_ELEM[scaling])


@needs_ext
def test_quantize_bytes_count_codes_and_every_scale(monkeypatch):
    """The GB/s of each quantizer divides these bytes; the 1x128 scales (3% of a layout's
    bytes) used to be left out, which put 1.0% (1.6% dual) too few bytes in its GB/s."""
    rows = []
    bench_lowp.bench_gpu_quantize(SimpleNamespace(repeat=1), rows, lambda: None, device="cpu",
                                  n=N)
    got = {(r["scaling"], r["dual"]): r["bytes_per_elem"] for r in rows}
    assert len(got) == 2 * 5 + 2 + 3
    for (scaling, dual), per in got.items():
        assert per == pytest.approx(expected_bytes_per_elem(scaling, dual), rel=1e-12), \
            (scaling, dual)
    assert got[("1x128", False)] == 3.03125 and got[("1x128", True)] == 4.0625
    for r in rows:  # GB/s are those bytes over the time, the copy's read + write alike
        assert r["of_copy"] == pytest.approx(r["gbs"] / r["copy_gbs"])


def test_quantize_bytes_refuse_an_output_they_cannot_count():
    with pytest.raises(TypeError, match="cannot count the bytes"):
        bench_lowp.output_bytes((torch.empty(4), {"scale": torch.empty(1)}))
    assert bench_lowp.output_bytes((torch.empty(4), None, [torch.empty(2, dtype=torch.uint8)])) \
        == 18


def adamw_bytes_per_param(step, numel: int) -> float:
    """What one step of a bench_optim CUDA contender must read and write, from the tensors it
    holds: each parameter, its gradient and its state (the step count aside) read, the
    parameter and the state written; torch's mixed recipe also copies its fp32 masters into
    the bf16 weights (read 4, write 2)."""
    cells = [c.cell_contents for c in (step.__closure__ or ())]
    opt = getattr(step, "__self__", None) or next(
        c for c in cells if isinstance(c, torch.optim.Optimizer))
    nbytes = lambda t: t.numel() * t.element_size()
    total = 0
    for group in opt.param_groups:
        for p in group["params"]:
            state = [t for k, t in opt.state[p].items() if k != "step"]
            total += 2 * nbytes(p) + nbytes(p.grad) + 2 * sum(nbytes(t) for t in state)
    copied = next((c for c in cells if isinstance(c, list) and c and c[0].dtype != torch.float32),
                  [])
    total += sum(3 * nbytes(w) for w in copied)  # fp32 read (2x the bf16) + bf16 written
    return total / numel


@needs_ext
def test_adamw_gpu_rows_bytes_and_gbs():
    """bench_optim's CUDA rows (run on the CPU): each contender's GB/s is its bytes per
    parameter, counted here from the tensors its step touches, times the parameters over its
    median step; the params label is the parameters timed (3/4 of the size asked for), to 3
    digits: one digit had 7.5e8 read as 8e8 in docs/gpu.md's TB/s (6.7% over)."""
    shapes, numel = [(64,)] * 48 + [(1024,)] * 16, 48 * 64 + 16 * 1024
    for (name, dtype), per in bench_optim.CUDA_BYTES_PER_PARAM.items():
        step = bench_optim.cuda_contender(name, shapes, getattr(torch, dtype), "cpu")
        step()  # the state exists after a step
        # compact state's scales: one per 256 elements and per tensor's last block (here
        # 64-element tensors hold one each: 0.05% over the whole-block count the bench uses)
        exact = pytest.approx(per, rel=1e-3) if name == "tierlift-compact" else per
        assert adamw_bytes_per_param(step, numel) == exact, (name, dtype)
    rows = []
    bench_optim.cuda_rows([64 * 64], 1, rows, lambda: None, device="cpu")
    assert [r["params"] for r in rows] == ["1.95e+04"] * 2 and rows[0]["numel"] == numel
    for r in rows:
        dtype = r["case"].split("-")[1]
        for name, ms in r["step_ms"].items():
            want = bench_optim.CUDA_BYTES_PER_PARAM[name, dtype] * numel / (ms / 1e3) / 1e9
            assert r[f"{name} GB/s"] == pytest.approx(want, rel=1e-12)


def test_finetune_row_tflops_divide_the_count_it_keeps(capsys):
    """A case's row (run_case, here the no-offload recipe of the tiny model on the CPU): TFLOPS
    and tokens/s are its count and tokens over its mean step, and the count is kept beside them
    (gpu_report marks rows without it as the older count)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--plot", default=None)
    of.add_finetune_args(ap)
    args = ap.parse_args(["--finetune-case", "torch-gpu", "--info", json.dumps(
        {"model": "tiny", "tier": "cpu"}), "--seq-len", "32", "--batch-size", "2", "--steps", "2",
        "--warmup", "1", "--max-grad-norm", "0"])
    of.run_case(args, "torch-gpu")
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("RESULT "))
    row = json.loads(line[len("RESULT "):])
    cfg = fs.config("tiny", 32)
    assert row["params"] == cfg.num_params()
    assert row["flops_per_step"] == of.flops_per_step(cfg, cfg.num_params(), 2, 32)
    assert row["tflops"] == pytest.approx(row["flops_per_step"] / row["step_s"] / 1e12, rel=1e-12)
    assert row["tokens_per_step"] == 64
    assert row["tokens_per_s"] == pytest.approx(64 / row["step_s"], rel=1e-12)
