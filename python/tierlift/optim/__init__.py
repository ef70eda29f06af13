"""Optimizers: drop-in torch.optim.Optimizer subclasses with fused CPU (SIMD) and CUDA steps."""

from tierlift.optim.adam import Adam, AdamW

__all__ = ["Adam", "AdamW"]
