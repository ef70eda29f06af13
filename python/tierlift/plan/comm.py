"""Bytes per step across nodes, and the time the link needs for them, for ZeRO-3 flat or
hierarchical (tierlift.zero.shard(hierarchy="node", grad_comm=..., fp8_all_gather=...)).

Counted as tierlift.zero's Comm counts them (the logical volume of a direct exchange, what this
rank sends to ranks on other nodes), per rank, for P parameters on N nodes of G ranks:

    flat ZeRO-3     gathers (forward and backward of each of m micro-batches) and the
                    reduce-scatter over all N*G ranks:  P (N-1)/N (2 m b_w + b_g)
    hierarchical    only the gradient shard's all-reduce across nodes (P/G elements):
                    2 P/G (N-1)/N b_g,   b_g = 1 + 4/256 with grad_comm int8 or fp8 (scales)

b_w: bytes per gathered weight (2 in bf16, 1 with FP8 gathers); b_g: per reduced gradient. A
node's link carries G ranks' worth; the time is that over the inter-node bandwidth. Weights
gathered and gradients reduced in fp32 (param_dtype="fp32": no MixedPrecision, which reduces in
its param_dtype) take 4 B each; int8 or fp8 codes are the same bytes whatever the weights' dtype.

The gradient is reduced once per step when every micro-batch but the last runs under
model.no_sync(); without it each backward reduces its gradient, m times the gradient bytes
(reduce_every_micro_batch=True; measured on 2 gloo ranks: 20% more flat, twice as much
hierarchical, at m = 2). With grad_comm int8 or fp8 each unit's shard is padded to a multiple of
N x 256 values before it is quantized: under N x 256 values more per unit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tierlift.plan.inputs import WEIGHT_BYTES

_QUANT_BLOCK = 256  # tierlift.zero.quant_comm's block: one fp32 scale per 256 codes


@dataclass(kw_only=True, frozen=True)
class CommLayout:
    name: str
    hierarchical: bool
    weight_bytes: float  # per gathered weight element
    grad_bytes: float    # per reduced gradient element on the cross-node leg


LAYOUTS = (
    CommLayout(name="ZeRO-3", hierarchical=False, weight_bytes=2, grad_bytes=2),
    CommLayout(name="hierarchy='node'", hierarchical=True, weight_bytes=2, grad_bytes=2),
    CommLayout(name="hierarchy='node', grad_comm='int8', fp8_all_gather", hierarchical=True,
               weight_bytes=1, grad_bytes=1 + 4 / _QUANT_BLOCK),
)


def layouts(param_dtype: str = "bf16") -> tuple[CommLayout, ...]:
    """LAYOUTS with the weights gathered and the gradients reduced in `param_dtype` (the
    quantized row's codes do not depend on it)."""
    each = WEIGHT_BYTES[param_dtype]
    return LAYOUTS if each == 2 else tuple(
        dataclasses.replace(layout, weight_bytes=each, grad_bytes=each)
        for layout in LAYOUTS[:2]) + LAYOUTS[2:]


def inter_node_bytes_per_rank(params: float, nodes: int, gpus_per_node: int,
                              layout: CommLayout, micro_batches: int = 1,
                              reduce_every_micro_batch: bool = False) -> float:
    """Bytes one rank sends to other nodes in one optimizer step of `micro_batches` forward
    and backward passes: the gradient is reduced once, after the last (the others under
    model.no_sync()), or after each with `reduce_every_micro_batch`."""
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"nodes and gpus_per_node must be >= 1, got {nodes}, {gpus_per_node}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    across = (nodes - 1) / nodes
    reduces = micro_batches if reduce_every_micro_batch else 1
    if layout.hierarchical:
        return 2 * reduces * params / gpus_per_node * across * layout.grad_bytes
    return params * across * (2 * micro_batches * layout.weight_bytes
                              + reduces * layout.grad_bytes)


@dataclass(kw_only=True)
class CommRow:
    layout: str
    per_node_bytes: float
    seconds: float
    vs_flat: float


def comm_plan(params: float, nodes: int, gpus_per_node: int, inter_node_gbps: float,
              micro_batches: int = 1, reduce_every_micro_batch: bool = False,
              param_dtype: str = "bf16") -> list[CommRow]:
    """Each layout's bytes a node sends to the others per step and the time at
    `inter_node_gbps` (gigabits per second per node, each way), weights gathered and gradients
    reduced in `param_dtype`."""
    rows = layouts(param_dtype)
    if not (math.isfinite(inter_node_gbps) and inter_node_gbps > 0):  # inf: 0 s, wrongly
        raise ValueError(f"inter_node_gbps must be a finite number > 0, got {inter_node_gbps}")
    per_node = [gpus_per_node * inter_node_bytes_per_rank(params, nodes, gpus_per_node,
                                                          layout, micro_batches,
                                                          reduce_every_micro_batch)
                for layout in rows]
    flat = per_node[0]  # the first row is flat ZeRO-3
    return [CommRow(layout=layout.name, per_node_bytes=b,
                    seconds=b / (inter_node_gbps * 1e9 / 8), vs_flat=b / flat if flat else 0.0)
            for layout, b in zip(rows, per_node, strict=True)]


def render_comm(rows: list[CommRow], nodes: int, gpus_per_node: int, gbps: float,
                micro_batches: int = 1, reduce_every_micro_batch: bool = False,
                param_dtype: str = "bf16") -> str:
    reduced = ""
    if micro_batches > 1:
        reduced = (f", {micro_batches} micro-batches, the gradient reduced after each"
                   if reduce_every_micro_batch else
                   f", {micro_batches} micro-batches, the gradient reduced once (model.no_sync() "
                   "around the others; without it: --reduce-every-micro-batch)")
    lines = [f"across nodes per step ({nodes} nodes x {gpus_per_node} GPUs, {gbps:g} Gb/s per "
             f"node, {param_dtype} weights and gradients{reduced}):",
             f"  {'layout':<55} {'GB per node':>12} {'seconds':>9} {'vs ZeRO-3':>10}"]
    for r in rows:
        lines.append(f"  {r.layout:<55} {r.per_node_bytes / 1e9:>12.2f} {r.seconds:>9.3f} "
                     f"{r.vs_flat:>9.3f}x")
    return "\n".join(lines)
