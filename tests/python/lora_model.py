"""A tiny model with a frozen base and LoRA adapters built by hand (nn.Linear pairs), for the
tests of frozen parameters under ZeRO stage 3: a frozen embedding (the first block's input
needs no gradient), blocks whose frozen base may be bf16, a frozen LayerNorm, element counts
that do not divide by the world size, and a trainable head bias next to its frozen weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

VOCAB, DIM, HIDDEN, RANK, LAYERS, SEQ = 53, 24, 40, 3, 3, 8


class LoraLinear(nn.Module):
    def __init__(self, n_in: int, n_out: int, base_dtype: torch.dtype) -> None:
        super().__init__()
        self.base = nn.Linear(n_in, n_out).to(base_dtype)
        self.lora_a = nn.Linear(n_in, RANK, bias=False)
        self.lora_b = nn.Linear(RANK, n_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base(x.to(self.base.weight.dtype)).to(x.dtype)
        return base + self.lora_b(self.lora_a(x))


class Block(nn.Module):
    def __init__(self, base_dtype: torch.dtype) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.up = LoraLinear(DIM, HIDDEN, base_dtype)
        self.down = LoraLinear(HIDDEN, DIM, base_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class LoraNet(nn.Module):
    def __init__(self, base_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.reentrant: bool | None = None  # activation checkpointing of each block, as HF
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(base_dtype) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        if self.reentrant is not None:
            # As Hugging Face's enable_input_require_grads(): the blocks' input needs a gradient.
            x.requires_grad_(True)
        for block in self.blocks:
            if self.reentrant is None:
                x = block(x)
            else:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(self.ln_f(x))


def make_lora(base_dtype: torch.dtype = torch.float32, seed: int = 0) -> LoraNet:
    """Everything frozen but the adapters and the head bias; lora_b non-zero so the adapters
    change the output from the first step."""
    torch.manual_seed(seed)
    model = LoraNet(base_dtype)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name or name == "head.bias")
        if "lora_b" in name:
            nn.init.normal_(p, std=0.05)
    return model


def base_numel(model: nn.Module) -> dict[torch.dtype, int]:
    """Elements of the frozen parameters, by dtype."""
    out: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if not p.requires_grad:
            out[p.dtype] = out.get(p.dtype, 0) + p.numel()
    return out


def batches(steps: int, batch: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g) for _ in range(steps)]


def fit(model, opt, data, *, world: int = 1, rank: int = 0) -> list[float]:
    """One step per global batch, each rank on its slice; the global mean loss of each step."""
    import torch.distributed as dist

    losses = []
    for seq in data:
        opt.zero_grad(set_to_none=True)
        local = seq.chunk(world)[rank]
        loss = F.cross_entropy(model(local[:, :-1]).flatten(0, 1), local[:, 1:].flatten())
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses
