"""One Python wrapper per tierlift op, plus the fake (meta) kernel of every op so the ops trace
under torch.compile and pass torch.library.opcheck.

Wrappers call torch.ops.tierlift.* when the compiled extension is loaded, else the pure-torch
reference (with the one-time warning _extension already gave).
"""

from __future__ import annotations

import torch

from tierlift import _extension, reference


def _has_kernel(tensor: torch.Tensor) -> bool:
    if not _extension.available():
        return False
    return tensor.device.type == "cpu" or (tensor.is_cuda and _extension.has_cuda_kernels())


def adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, *, lr,
               beta1, beta2, eps, weight_decay, step, decoupled, amsgrad, maximize) -> None:
    """Fused Adam/AdamW update of fp32 `params` (weights or master weights) in place.

    `param_copies` is empty or holds, per param, a tensor that receives the updated weight in its
    own dtype (bf16/fp16/fp32): the low-precision model weight whose master `params` is.
    """
    args = (list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(max_exp_avg_sqs),
            list(param_copies), float(lr), float(beta1), float(beta2), float(eps),
            float(weight_decay), int(step), bool(decoupled), bool(amsgrad), bool(maximize))
    if params and _has_kernel(params[0]):
        torch.ops.tierlift.adam_step_(*args)
    else:
        reference.adam_step_(*args)


if _extension.available():

    @torch.library.register_fake("tierlift::adam_step_")
    def _adam_step_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, param_copies, lr,
                        beta1, beta2, eps, weight_decay, step, decoupled, amsgrad, maximize):
        return None


# ---- zero ----


def flatten_pack_(flat: torch.Tensor, tensors) -> None:
    """Copy `tensors` back to back into the 1-D `flat` and zero the padding after them."""
    tensors = list(tensors)
    if _has_kernel(flat):
        torch.ops.tierlift.flatten_pack_(flat, tensors)
    else:
        reference.flatten_pack_(flat, tensors)


def unflatten_(flat: torch.Tensor, tensors) -> None:
    """Copy consecutive slices of the 1-D `flat` into `tensors` (each contiguous), in place."""
    tensors = list(tensors)
    if _has_kernel(flat):
        torch.ops.tierlift.unflatten_(flat, tensors)
    else:
        reference.unflatten_(flat, tensors)


if _extension.available():

    @torch.library.register_fake("tierlift::flatten_pack_")
    def _flatten_pack_fake(flat, tensors):
        return None

    @torch.library.register_fake("tierlift::unflatten_")
    def _unflatten_fake(flat, tensors):
        return None
