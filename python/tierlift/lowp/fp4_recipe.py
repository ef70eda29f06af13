"""FP4 training recipes: how each of FP4Linear's three GEMMs quantizes its operands.

  mxfp4-quartet  Quartet (Castro et al. 2025): forward x and W rotated by a 32-point Hadamard
                 along K and quantized with the QuEST rule (E8M0 scale from the RMS, clip mask
                 kept: gradients of clipped elements are zeroed); backward operands rotated by a
                 freshly random-signed Hadamard along each GEMM's reduction dimension and
                 stochastically rounded (RCEIL scales: nothing saturates, so SR stays unbiased).
  nvfp4          Transformer Engine's NVFP4: E4M3 scale per 16 values and an fp32 tensor scale;
                 weights in 16x16 blocks (so W^T's quantization is W's, reused by dgrad); random
                 Hadamard (16) on the wgrad inputs; stochastic rounding on gradients only.
  mxfp4-rtn      The plain baseline: MXFP4 with the OCP floor rule and round-to-nearest for every
                 operand, no Hadamard, no clip mask.
"""

from __future__ import annotations

from dataclasses import dataclass

_RULES = ("floor", "rceil", "quest", "nv")


@dataclass(frozen=True, kw_only=True)
class FP4Recipe:
    name: str
    forward_rule: str  # floor | rceil | quest | nv
    forward_hadamard: int  # 0 or 32: rotation of x and W along K (undone on the gradients)
    weight_2d: bool  # nv only: 16x16 weight blocks; dgrad reuses the forward weight
    clip_mask: bool  # zero the gradient of elements the forward quantizer saturated
    backward_rule: str
    dgrad_hadamard: int  # rotation along N for grad_input's GEMM (0, 16, 32)
    wgrad_hadamard: int  # rotation along M (tokens) for grad_weight's GEMM
    random_signs: bool  # fresh random signs for the backward rotations
    stochastic_grad: bool  # SR on grad_output
    stochastic_other: bool  # SR on the other backward operand (W, x) as well

    def __post_init__(self):
        for field_name in ("forward_rule", "backward_rule"):
            if getattr(self, field_name) not in _RULES:
                raise ValueError(f"{field_name} must be one of {_RULES}, got "
                                 f"{getattr(self, field_name)!r}")
        for field_name in ("forward_hadamard", "dgrad_hadamard", "wgrad_hadamard"):
            if getattr(self, field_name) not in (0, 16, 32):
                raise ValueError(f"{field_name} must be 0, 16 or 32, got "
                                 f"{getattr(self, field_name)}")
        if self.forward_hadamard == 16:
            raise ValueError("forward_hadamard must be 0 or 32 (16 would not divide MXFP4 "
                             "blocks' rotation back on the gradients)")
        if self.weight_2d and self.forward_rule != "nv":
            raise ValueError("weight_2d needs forward_rule='nv'")
        if self.weight_2d and self.dgrad_hadamard:
            # the dgrad reuses the forward's 16x16-block W: there is no W^T quantization to rotate
            raise ValueError(f"dgrad_hadamard={self.dgrad_hadamard} with weight_2d=True: the dgrad "
                             f"reuses the forward's 16x16-block weight, so no rotation would be "
                             f"applied; set dgrad_hadamard=0, or weight_2d=False to rotate it")


FP4_RECIPES: dict[str, FP4Recipe] = {
    r.name: r
    for r in (
        FP4Recipe(name="mxfp4-quartet", forward_rule="quest", forward_hadamard=32,
                  weight_2d=False, clip_mask=True, backward_rule="rceil", dgrad_hadamard=32,
                  wgrad_hadamard=32, random_signs=True, stochastic_grad=True,
                  stochastic_other=True),
        FP4Recipe(name="nvfp4", forward_rule="nv", forward_hadamard=0, weight_2d=True,
                  clip_mask=False, backward_rule="nv", dgrad_hadamard=0, wgrad_hadamard=16,
                  random_signs=True, stochastic_grad=True, stochastic_other=False),
        FP4Recipe(name="mxfp4-rtn", forward_rule="floor", forward_hadamard=0, weight_2d=False,
                  clip_mask=False, backward_rule="floor", dgrad_hadamard=0, wgrad_hadamard=0,
                  random_signs=False, stochastic_grad=False, stochastic_other=False),
    )
}


def get_fp4_recipe(recipe: str | FP4Recipe) -> FP4Recipe:
    if isinstance(recipe, FP4Recipe):
        return recipe
    if recipe not in FP4_RECIPES:
        raise ValueError(f"recipe must be one of {sorted(FP4_RECIPES)} or an FP4Recipe, "
                         f"got {recipe!r}")
    return FP4_RECIPES[recipe]
