"""Everyday training-script idioms around converted layers: torch's fused inference paths that
would bypass them, weights edited or reloaded mid-training, eval between steps, gradient
accumulation, weight tying, copies and dtype casts after conversion. The just-in-time layers
keep no state (no cached quantized weight, no amax history), so each of these must give what a
fresh conversion of the same weights gives. The delayed recipe keeps amax histories: its idioms
are in test_lowp_delayed.py."""

import contextlib
import copy
import pickle

import pytest
import torch
from torch import nn

from tierlift.lowp import (
    FP4_RECIPES,
    RECIPES,
    Float8Linear,
    FP4Linear,
    convert,
    float8_linear,
    fp4_linear,
)

ALL_RECIPES = sorted(r for r in RECIPES if not RECIPES[r].delayed) + sorted(FP4_RECIPES)
# No random draws in their forward and backward: results repeat without reseeding.
DETERMINISTIC = ["fp8-rowwise", "fp8-tensorwise", "mxfp4-rtn"]


@contextlib.contextmanager
def _no_fast_path():
    """torch's own switch for the fused MHA / encoder-layer kernels: the reference path, where
    every submodule's forward runs."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def _encoder_layer():
    return nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)


@pytest.mark.parametrize("recipe", ["fp8-rowwise", "mxfp4-rtn"])
def test_encoder_layer_eval_runs_its_converted_linears(recipe, one_thread):
    # In eval under no_grad nn.TransformerEncoderLayer handed linear1/linear2's weights to one
    # fused fp32 kernel: the converted layers were silently skipped (eval output = the plain
    # model's, 3% (FP8) to 20% (FP4) away from the converted model's own).
    torch.manual_seed(0)
    layer = _encoder_layer()
    plain = copy.deepcopy(layer).eval()
    assert convert(layer, recipe, min_features=0).converted == ["linear1", "linear2"]
    layer.eval()
    x = torch.randn(2, 8, 64)
    with torch.no_grad():
        y = layer(x)
        with _no_fast_path():
            want = layer(x)
        y_plain = plain(x)
    # Only the attention's own (unconverted) fused kernel may differ from the reference path.
    torch.testing.assert_close(y, want, rtol=0, atol=1e-5)
    assert (y_plain - want).abs().max() > 1e-2  # the test can tell the two paths apart
    again = convert(layer, recipe, min_features=0)  # idempotent: one hook per layer
    assert again.converted == [] and len(layer.linear1._forward_pre_hooks) == 1


def test_encoder_stack_with_a_padding_mask_runs_its_converted_linears(one_thread):
    # nn.TransformerEncoder's eval path turns a padded batch into a nested tensor for the fused
    # layers; with the layers on their regular path that tensor would reach the FP8 GEMMs.
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(_encoder_layer(), 2, enable_nested_tensor=True)
    convert(enc, "fp8-rowwise", min_features=0)
    enc.eval()
    x = torch.randn(2, 8, 64)
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[1, 5:] = True
    with torch.no_grad():
        y = enc(x, src_key_padding_mask=pad)
        with _no_fast_path():
            want = enc(x, src_key_padding_mask=pad)
    torch.testing.assert_close(y[~pad], want[~pad], rtol=0, atol=1e-5)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("recipe", ["fp8-rowwise", "nvfp4"])
def test_a_nested_input_is_refused_by_name(recipe):
    # It failed inside with torch's "NestedTensorImpl doesn't support sizes. Please file an issue."
    lin = nn.Linear(64, 32)
    convert(lin, recipe, min_features=0)
    x = torch.nested.nested_tensor([torch.randn(3, 64), torch.randn(5, 64)])
    with pytest.raises(TypeError, match="not nested tensors"):
        lin(x)


class FusedLossHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(64, 64)
        self.loss = nn.LinearCrossEntropyLoss(64, 128)  # holds the head as an nn.Linear

    def forward(self, x, target):
        return self.loss(torch.tanh(self.body(x)), target)


@pytest.mark.skipif(not hasattr(nn, "LinearCrossEntropyLoss"), reason="torch without it")
def test_a_linear_whose_parent_reads_only_its_weight_is_kept_and_says_why(one_thread):
    # F.linear_cross_entropy takes loss.linear's weight, never its forward: it was reported
    # converted (even when a filter asked for it) and ran in high precision.
    model = FusedLossHead()
    report = convert(model, "fp8-rowwise", lambda mod, fqn: True)
    assert report.converted == ["body"] and isinstance(model.body, Float8Linear)
    assert "F.linear_cross_entropy" in report.skipped["loss.linear"]
    assert type(model.loss.linear) is nn.Linear


def test_a_plain_linear_set_as_attention_out_proj_is_kept_and_says_why():
    # MultiheadAttention hands out_proj.weight to F.multi_head_attention_forward; its own
    # out_proj is a subclass (kept), a plain nn.Linear put there was reported converted.
    attn = nn.MultiheadAttention(64, 4, batch_first=True)
    attn.out_proj = nn.Linear(64, 64)
    report = convert(attn, "fp8-rowwise", min_features=0)
    assert report.converted == [] and type(attn.out_proj) is nn.Linear
    assert "F.multi_head_attention_forward" in report.skipped["out_proj"]


def _mlp():
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))


def _grads(model, x, seed=3):
    """Output and parameter grads of one forward + backward (seeded: FP4's SR draws)."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.square().sum().backward()
    return [y.detach()] + [p.grad for p in model.parameters()]


def _equal(a, b) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def _converted(model, recipe):
    model = copy.deepcopy(model)
    convert(model, recipe, min_features=0)
    return model


@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_weights_edited_mid_training_are_the_ones_the_next_step_uses(recipe, one_thread):
    torch.manual_seed(0)
    plain, other = _mlp(), _mlp()
    low = _converted(plain, recipe)
    x = torch.randn(8, 64)
    _grads(low, x)
    low[0].weight.data.copy_(other[0].weight)  # each edit, then a fresh conversion of the result
    plain[0].weight.data.copy_(other[0].weight)
    assert _equal(_grads(low, x), _grads(_converted(plain, recipe), x))
    for m in (low, plain):
        torch.manual_seed(7)
        m.apply(lambda mod: nn.init.normal_(mod.weight) if isinstance(mod, nn.Linear) else None)
    assert _equal(_grads(low, x), _grads(_converted(plain, recipe), x))
    low.load_state_dict(other.state_dict())
    assert _equal(_grads(low, x), _grads(_converted(other, recipe), x))


@pytest.mark.parametrize("recipe", DETERMINISTIC)
def test_eval_between_steps_and_accumulation_leave_no_trace(recipe, one_thread):
    torch.manual_seed(0)
    low = _converted(_mlp(), recipe)
    x1, x2 = torch.randn(8, 64), torch.randn(8, 64)
    want = _grads(copy.deepcopy(low), x1)
    with torch.no_grad():
        low(x2)
    with torch.inference_mode():
        low(x2)
    assert _equal(_grads(low, x1), want)
    g2 = _grads(copy.deepcopy(low), x2)[1:]
    low.zero_grad(set_to_none=False)  # two micro-batches into the same .grad tensors
    low(x1).square().sum().backward()
    low(x2).square().sum().backward()
    for p, a, b in zip(low.parameters(), want[1:], g2, strict=True):
        assert torch.equal(p.grad, a + b)


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.emb(idx)))


@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_a_tied_head_gets_both_gradients(recipe, one_thread):
    torch.manual_seed(0)
    model = _converted(TiedLM(), recipe)
    assert model.head.weight is model.emb.weight
    idx = torch.randint(0, 64, (4, 8))
    _grads(model, idx, seed=1)
    # untied copies of the same weight, the functional layer: the tied grad is their sum
    emb = model.emb.weight.detach().clone().requires_grad_()
    head = model.emb.weight.detach().clone().requires_grad_()
    fn = float8_linear if recipe in RECIPES else fp4_linear
    torch.manual_seed(1)
    fn(torch.tanh(nn.functional.embedding(idx, emb)), head, None, recipe).square().sum().backward()
    assert torch.equal(model.emb.weight.grad, emb.grad + head.grad)


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "mxfp4-rtn", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_copies_and_casts_after_conversion_match_converting_after(recipe, dtype, one_thread):
    torch.manual_seed(0)
    plain = _mlp()
    low = _converted(plain, recipe)
    twin = copy.deepcopy(low)
    with torch.no_grad():
        twin[0].weight.mul_(2)  # the copy shares nothing with the original
    x32 = torch.randn(8, 64)
    assert _equal(_grads(low, x32), _grads(_converted(plain, recipe), x32))
    x = torch.randn(8, 64, dtype=dtype)
    cast_after = copy.deepcopy(low).to(dtype)
    cast_before = _converted(copy.deepcopy(plain).to(dtype), recipe)
    assert _equal(_grads(cast_after, x), _grads(cast_before, x))
    assert all(p.grad.dtype == dtype for p in cast_after.parameters())


@pytest.mark.parametrize("recipe", ["fp8-rowwise", "mxfp4-rtn"])
def test_low_precision_layers_put_in_an_encoder_layer_by_hand_run_in_eval(recipe, one_thread):
    # The drop-in classes set in place without convert (from_linear, or built and loaded): the
    # eval fast path handed their weights to the fused fp32 kernel (3% off the layer's own).
    cls = Float8Linear if recipe in RECIPES else FP4Linear
    torch.manual_seed(0)
    layer = _encoder_layer().eval()
    layer.linear1 = cls.from_linear(layer.linear1, recipe=recipe)
    built = cls(128, 64, recipe=recipe)
    built.load_state_dict(layer.linear2.state_dict())
    layer.linear2 = built
    for model in (layer, copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        x = torch.randn(2, 8, 64)
        with torch.no_grad():
            y = model(x)
            with _no_fast_path():
                want = model(x)
        torch.testing.assert_close(y, want, rtol=0, atol=1e-5)
    assert len(layer.linear1._forward_pre_hooks) == 1
    convert(layer, recipe, min_features=0)  # already low precision: no second hook
    assert len(layer.linear1._forward_pre_hooks) == len(layer.linear2._forward_pre_hooks) == 1
