"""Delayed scaling (fp8-tensorwise-delayed) under what training code does around a step: a save
(state_dict, deepcopy, pickle) between the backwards of micro-batches whose forwards ran first
changes no gradient and no history, with or without checkpointing; a strict=False load of a
dict that names other layers leaves a layer's histories and queue alone; a second backward of
one forward (retain_graph) adds x's amax once; an evaluation under inference_mode leaves
histories that loads and buffer broadcasts can write; a forward held without backward keeps the
queue bounded and warns. Two gloo ranks (one spawn): DDP and ZeRO stages 1 and 2 with such
evaluations, and a process group made again with reductions queued, hold one process's
histories."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tierlift.lowp import RECIPES, Float8Linear, convert, delayed
from tierlift.reference import lowp as ref

DELAYED = "fp8-tensorwise-delayed"


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    convert(model, DELAYED, min_features=0)
    return model


def _histories(model):
    return {k: v.clone() for k, v in model.state_dict().items() if "amax_history" in k}


def _step_with_interleaved_backwards(model, save, checkpointed):
    """A filled history, then two micro-batches' forwards before their backwards (in reverse
    order), with `save(model)` between the backwards. The backward run first brings the
    largest amaxes yet: had they entered at the save, the other backward (and its recompute)
    would scale by them."""
    fwd = (lambda x: checkpoint(model, x, use_reentrant=False)) if checkpointed else model
    gen = torch.Generator().manual_seed(1)
    model(torch.randn(8, 16, generator=gen)).square().sum().backward()
    model.zero_grad(set_to_none=True)
    xs = [torch.randn(8, 16, generator=gen) * c for c in (1.0, 20.0)]
    ys = [fwd(x.requires_grad_()) for x in xs]
    ys[1].square().sum().backward()
    saved = save(model)
    ys[0].square().sum().backward()
    return [p.grad.clone() for p in model.parameters()], _histories(model), saved


def _saved_histories(model):
    return _histories(model)


def _pickled(model):
    return _histories(pickle.loads(pickle.dumps(model)))


def _deepcopied(model):
    return _histories(copy.deepcopy(model))


def test_a_save_between_backwards_changes_no_gradient_and_no_history():
    for checkpointed in (False, True):
        want_grads, want_hist, _ = _step_with_interleaved_backwards(
            _mlp(), lambda m: None, checkpointed)
        for save in (_saved_histories, _pickled, _deepcopied):
            grads, hist, saved = _step_with_interleaved_backwards(_mlp(), save, checkpointed)
            for a, b in zip(grads, want_grads, strict=True):
                assert torch.equal(a, b), (save.__name__, checkpointed, (a - b).abs().max())
            assert all(torch.equal(hist[k], v) for k, v in want_hist.items())
            # the save holds the amaxes queued by then (the backward run first's, newest)
            for k, v in saved.items():
                assert v[0] > 0 and torch.equal(v[1:2], want_hist[k][2:3]), k


def test_a_partial_load_leaves_the_histories_of_layers_it_does_not_name():
    model = _mlp()
    for c in (1.0, 3.0):
        model(torch.randn(8, 16) * c).square().sum().backward()
    x = torch.randn(8, 16) * 5
    model(x).square().sum().backward()  # queued, not in the histories yet
    queued = len(delayed.pending(model[0]).items)
    head = model[2].weight.detach().clone()
    result = model.load_state_dict({"2.weight": head}, strict=False)  # an adapter-style dict
    assert "0.weight" in result.missing_keys
    assert len(delayed.pending(model[0]).items) == queued
    hist = _histories(model)
    assert hist["0.fp8_amax_history_x"][0] == ref.block_amax(x, "tensor").reshape(())
    assert (hist["0.fp8_amax_history_x"] > 0).sum() == 3
    # a dict naming the layer without its histories (a plain nn.Linear's) restarts them
    assert (hist["2.fp8_amax_history_x"] == delayed.NEVER_WRITTEN).all()
    assert (hist["2.fp8_amax_history_g"] == delayed.NEVER_WRITTEN).all()


def test_a_second_backward_of_one_forward_adds_x_once():
    model = _mlp()
    x = torch.randn(8, 16, requires_grad=True)
    loss = model(x).square().sum()
    loss.backward(retain_graph=True)
    loss.backward()
    hist = _histories(model)
    for i in (0, 2):
        assert (hist[f"{i}.fp8_amax_history_x"] > 0).sum() == 1  # one quantize of x
        assert (hist[f"{i}.fp8_amax_history_g"] > 0).sum() == 2  # g quantized in each backward


def test_an_evaluation_under_inference_mode_leaves_ordinary_histories():
    # a training step, an evaluation under inference_mode (Lightning's, generate()'s), a step:
    # the histories stay tensors DDP's and ZeRO's buffer broadcasts and loads can write in place
    def run(evaluation):
        model = _mlp()
        gen = torch.Generator().manual_seed(2)
        model(torch.randn(8, 16, generator=gen)).square().sum().backward()
        with evaluation():
            model(torch.randn(8, 16, generator=gen))
        model(torch.randn(8, 16, generator=gen) * 3).square().sum().backward()
        return model

    model = run(torch.inference_mode)
    buffers = tuple(model.buffers())
    assert not any(b.is_inference() for b in buffers)
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buffers):
        for b in buffers:  # what a broadcast from rank 0 does
            b.copy_(b.clone())
    want = _histories(run(torch.no_grad))
    model.load_state_dict(model.state_dict())
    assert all(torch.equal(v, want[k]) for k, v in _histories(model).items())


def _prefilled_mlp():
    """Histories holding one amax above every one here: every rank (and one process) takes the
    same scales from the first step on."""
    model = _mlp()
    sd = model.state_dict()
    for k, v in sd.items():
        if "amax_history" in k:
            v.fill_(delayed.NEVER_WRITTEN)[0] = 100.0
    model.load_state_dict(sd)
    return model


def _global_batches(world):
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(8 * world, 16, generator=gen) * c for c in (1.0, 0.5, 2.0)]


def _train_with_evaluations(model, rank, world):
    """Steps with an evaluation under inference_mode after each (the buffer broadcast of the
    second step after it wrote into the histories the evaluation made)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the same weights: histories comparable
    for xb in _global_batches(world):
        opt.zero_grad()
        model(xb.chunk(world)[rank]).square().sum().backward()  # a sum: each sample's g as alone
        opt.step()
        with torch.inference_mode():
            model(xb.chunk(world)[rank])
    return _histories(getattr(model, "module", model))


def _dist_cases(rank, world, tmp):
    import datetime

    import torch.distributed as dist

    import tierlift

    out = {"ddp": _train_with_evaluations(nn.parallel.DistributedDataParallel(
        _prefilled_mlp()), rank, world)}
    for stage in (1, 2):
        out[f"zero{stage}"] = _train_with_evaluations(
            tierlift.zero.shard(_prefilled_mlp(), stage=stage), rank, world)
    # the process group destroyed and made again with amax reductions queued
    model = _prefilled_mlp()
    batches = _global_batches(world)
    for xb in batches[:2]:
        model(xb.chunk(world)[rank]).square().sum().backward()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/regroup", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    model(batches[2].chunk(world)[rank]).square().sum().backward()
    out["regrouped"] = _histories(model)
    return out


def test_data_parallel_evaluations_stages_and_a_new_group_keep_one_history(tmp_path):
    from zero_model import spawn_ranks

    ranks = spawn_ranks(_dist_cases, str(tmp_path))
    one = _prefilled_mlp()
    for xb in _global_batches(2):
        one(xb).square().sum().backward()
    want = _histories(one)
    for out in ranks:
        for case in ("ddp", "zero1", "zero2", "regrouped"):
            assert out[case].keys() == want.keys()
            assert all(torch.equal(out[case][k], v) for k, v in want.items()), case


def test_a_forward_held_without_backward_keeps_the_queue_bounded_and_warns():
    # a notebook keeps the traceback of a failed step, and with it a forward's graph: the
    # histories wait for it; the queue keeps only what a flush would write, and says why
    short = dataclasses.replace(RECIPES[DELAYED], name="short", amax_history_len=2)
    layer = Float8Linear(16, 16, recipe=short)
    held = layer(torch.randn(8, 16, requires_grad=True))  # never backwarded
    length = layer.recipe.amax_history_len
    gen = torch.Generator().manual_seed(4)
    amaxes = []
    with pytest.warns(UserWarning, match="have not entered its histories"):
        for i in range(delayed.HELD_WARNING * length // 2):
            x = torch.randn(4, 16, generator=gen) * (1 + i % 7)
            layer(x).square().sum().backward()
            amaxes.append(ref.block_amax(x, "tensor").reshape(()))
    assert len(delayed.pending(layer).items) == 2 * length
    assert (layer.fp8_amax_history_x == delayed.NEVER_WRITTEN).all()  # still waiting
    del held
    layer(torch.randn(4, 16))
    assert torch.equal(layer.fp8_amax_history_x, torch.stack(amaxes[::-1][:length]))
