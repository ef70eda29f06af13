"""FP4Linear: nn.Linear whose three GEMMs take FP4 (MXFP4 / NVFP4) operands.

forward   y   = Q(R x) @ Q(R W)^T                R: optional 32-point Hadamard along K
backward  gx  = R^T (m_x * (Q(gy S) @ Q(W_r^T S)^T))     S: (random-signed) Hadamard along N
          gW  = R^T (m_w * (Q(gy^T T) @ Q(x_r^T T)^T))   T: (random-signed) Hadamard along M
Q quantizes along each GEMM's reduction dimension (what an FP4 tensor core consumes); both
operands of a GEMM get the same rotation, which therefore cancels in the product. m_x, m_w are
the forward quantizer's clip masks (Quartet/QuEST: no gradient through saturated elements).

The GEMMs are emulated exactly: dequantize to fp32 (every FP4 x scale product is exact) and
matmul. That is what runs on CPU and on Hopper; torch exposes no FP4 block-scaled matmul this
code can test (sm100+ only), so no native path is wired in. Random signs and stochastic-rounding
seeds (62-bit Philox keys) are drawn from torch's default CPU generator, one draw per quantized
operand, in a fixed order: torch.manual_seed(s) makes a run repeatable (on CPU bit for bit; on
a GPU the quantizer draws the same bits, the fp32 matmuls follow cuBLAS's determinism).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from tierlift import ops
from tierlift.lowp.fp4_recipe import FP4Recipe, get_fp4_recipe
from tierlift.lowp.gemm import as_dtype, autocast_off
from tierlift.lowp.linear import keep_off_fused_paths, linear_input, refuse_nested
from tierlift.reference.lowp_fp4 import fp4_dequantize, hadamard


def rotate(t: torch.Tensor, n: int) -> torch.Tensor:
    """fp32 blockwise Hadamard rotation of t's rows: the quantizer's own butterflies (the same fp32
    operations in the same order as the C++ and CUDA kernels), so rotating here and quantizing
    with hadamard=0 gives the same bits as quantizing with hadamard=n."""
    return hadamard(t, n)


def _draw(bits: int) -> int:
    # The CPU generator whatever torch.set_default_device says: a CUDA draw would sync the device
    # on .item() and come from a generator torch.get_rng_state() does not save.
    return int(torch.randint(0, 1 << bits, (), dtype=torch.int64, device="cpu").item())


def _pad_cols(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -t.shape[1] % multiple
    return torch.nn.functional.pad(t, (0, extra)) if extra else t


def qdq(t: torch.Tensor, rule: str, had: int = 0, signs: int = 0, stochastic: bool = False,
        block_2d: bool = False, want_mask: bool = False):
    """(fp32 dequantized FP4 copy of t (rotated when had), clip mask or None)."""
    seed = _draw(62) if stochastic else 0
    codes, scales, ts, mask = ops.fp4_quantize(t, rule, had, signs, stochastic, seed, 0, block_2d,
                                               want_mask)
    return fp4_dequantize(codes, scales, ts, rule, block_2d), (mask if want_mask else None)


def _gemm_operand_pair(a: torch.Tensor, b: torch.Tensor, r: FP4Recipe, had: int, grad_first: bool):
    """a @ b^T with both operands quantized along their shared (column) dimension."""
    block = 32 if r.backward_rule != "nv" else 16
    mult = max(block, had)
    a, b = _pad_cols(a, mult), _pad_cols(b, mult)  # zero padding adds nothing to the product
    signs = _draw(had) if (had and r.random_signs) else 0
    sr_a = r.stochastic_grad if grad_first else r.stochastic_other
    sr_b = r.stochastic_other if grad_first else r.stochastic_grad
    aq, _ = qdq(a, r.backward_rule, had, signs, sr_a)
    bq, _ = qdq(b, r.backward_rule, had, signs, sr_b)
    return aq @ bq.t()


class _FP4MatmulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: FP4Recipe):
        r = recipe
        with autocast_off(x.device.type):
            xq, mx = qdq(x, r.forward_rule, r.forward_hadamard, want_mask=r.clip_mask)
            wq, mw = qdq(weight, r.forward_rule, r.forward_hadamard, block_2d=r.weight_2d,
                         want_mask=r.clip_mask)
            y = xq @ wq.t()
        ctx.recipe = r
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.save_for_backward(x, weight, wq if r.weight_2d else None, mx, mw)
        return as_dtype(y, x.dtype)

    @staticmethod
    @once_differentiable  # its GEMMs are not differentiable: a second derivative is refused
    def backward(ctx, grad_out: torch.Tensor):
        r = ctx.recipe
        x, weight, wq, mx, mw = ctx.saved_tensors
        # A gradient nobody asked for (a frozen weight, the first layer's input) is not computed:
        # its quantizations and GEMM would be half the backward, and its draws wasted.
        need_gx, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g = grad_out.float()
        gx = gw = None
        with autocast_off(g.device.type):
            rot = r.forward_hadamard
            if need_gx:
                if r.weight_2d:  # the 16x16-block quantization of W serves W^T as well
                    gq, _ = qdq(_pad_cols(g, 16), r.backward_rule, 0, 0, r.stochastic_grad)
                    gx = gq[:, :g.shape[1]] @ wq
                else:
                    wr = rotate(weight, rot) if rot else weight.float()
                    gx = _gemm_operand_pair(g, wr.t().contiguous(), r, r.dgrad_hadamard, True)
                if mx is not None:
                    gx = gx * mx
                gx = (rotate(gx, rot) if rot else gx).to(ctx.x_dtype)
            if need_gw:
                xr = rotate(x, rot) if rot else x.float()
                gw = _gemm_operand_pair(g.t().contiguous(), xr.t().contiguous(), r,
                                        r.wgrad_hadamard, True)
                if mw is not None:
                    gw = gw * mw
                gw = (rotate(gw, rot) if rot else gw).to(ctx.w_dtype)
        return gx, gw, None


def fp4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               recipe: str | FP4Recipe = "mxfp4-quartet") -> torch.Tensor:
    """Functional form: F.linear(x, weight, bias) with FP4 GEMMs (x: [..., in_features])."""
    recipe = get_fp4_recipe(recipe)
    refuse_nested(x)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x must have {weight.shape[1]} features in its last dimension, got "
                         f"shape {tuple(x.shape)}")
    if weight.shape[1] % 32 or weight.shape[0] % 32:
        raise ValueError(f"weight must have in/out features that are multiples of 32 for FP4, "
                         f"got shape {tuple(weight.shape)}")
    x = linear_input(x, weight, bias)
    lead = x.shape[:-1]
    y = _FP4MatmulFn.apply(x.reshape(-1, x.shape[-1]), weight, recipe)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, weight.shape[0])


class FP4Linear(nn.Linear):
    """Drop-in nn.Linear with FP4 forward/backward GEMMs; parameters stay in their dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: str | FP4Recipe = "mxfp4-quartet", device=None, dtype=None):
        if in_features % 32 or out_features % 32:
            raise ValueError(f"in_features and out_features must be multiples of 32 for FP4, "
                             f"got {in_features}, {out_features}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = get_fp4_recipe(recipe)
        keep_off_fused_paths(self)

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe: str | FP4Recipe = "mxfp4-quartet") -> FP4Linear:
        """An FP4Linear sharing `mod`'s parameters (no copy)."""
        new = cls(mod.in_features, mod.out_features, bias=False, recipe=recipe, device="meta")
        new.weight = mod.weight
        new.bias = mod.bias
        new.train(mod.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp4_linear(x, self.weight, self.bias, self.recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}"
