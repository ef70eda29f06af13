"""convert(model, recipe): nn.Linear layers become Float8Linear / FP4Linear where it can pay off."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn
from torch.nn.utils import parametrize

from tierlift.lowp import delayed
from tierlift.lowp.fp4 import FP4Linear
from tierlift.lowp.fp4_recipe import FP4_RECIPES, FP4Recipe, get_fp4_recipe
from tierlift.lowp.linear import QUANTIZED_DTYPES, Float8Linear, keep_off_fused_paths
from tierlift.lowp.recipe import RECIPES, Float8Recipe, get_recipe

log = logging.getLogger("tierlift.lowp")
# Below this min(in_features, out_features) quantizing costs more than the FP8 GEMM saves.
DEFAULT_MIN_FEATURES = 1024


@dataclass(kw_only=True)
class ConversionReport:
    recipe: str
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # module name -> reason
    # layers an earlier convert made low precision (module name -> class and recipe): unchanged
    already_converted: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"tierlift.lowp.convert({self.recipe}): {len(self.converted)} converted, "
                 f"{len(self.skipped)} kept in high precision"]
        lines += [f"  kept {_shown(name)}: {why}" for name, why in self.skipped.items()]
        lines += [f"  already converted {_shown(name)}: {what}, left as it is"
                  for name, what in self.already_converted.items()]
        return "\n".join(lines)


def _shown(name: str) -> str:
    return name or "(the model itself)"  # "" is the root's name, as in named_modules()


def _skip_reason(name: str, mod: nn.Linear, module_filter_fn, min_features: int,
                 multiple: int = 16) -> str | None:
    kind = "FP8" if multiple == 16 else "FP4"
    if mod.weight.dtype not in QUANTIZED_DTYPES:  # the layer could never run its forward
        return (f"weight dtype {mod.weight.dtype}: the {kind} quantizers take float32, bfloat16 "
                f"or float16")
    if mod.in_features % multiple or mod.out_features % multiple:
        return (f"in_features={mod.in_features}, out_features={mod.out_features}: {kind} GEMMs "
                f"need multiples of {multiple}")
    if module_filter_fn is not None:
        return None if module_filter_fn(mod, name) else "excluded by module_filter_fn"
    if min(mod.in_features, mod.out_features) < min_features:
        return (f"too small to gain (min(in, out) = {min(mod.in_features, mod.out_features)} < "
                f"min_features={min_features}): quantization would cost more than the GEMM saves")
    return None


def _resolve(recipe):
    if isinstance(recipe, FP4Recipe) or (isinstance(recipe, str) and recipe in FP4_RECIPES):
        return get_fp4_recipe(recipe), FP4Linear, 32
    if isinstance(recipe, str) and recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {sorted(RECIPES) + sorted(FP4_RECIPES)}, a "
                         f"Float8Recipe or an FP4Recipe, got {recipe!r}")
    return get_recipe(recipe), Float8Linear, 16


def convert(model: nn.Module, recipe: str | Float8Recipe | FP4Recipe = "fp8-rowwise",
            module_filter_fn: Callable[[nn.Module, str], bool] | None = None, *,
            min_features: int | None = None) -> ConversionReport:
    """Turn, in place, each nn.Linear of `model` into a Float8Linear (FP8 recipes) or an
    FP4Linear ("mxfp4-quartet", "nvfp4", "mxfp4-rtn"): the same module object, so its
    parameters, buffers, hooks, training flag and every path to it stay as they were.

    Layers whose dimensions are not multiples of 16 (FP8) or 32 (FP4), and float64 layers (the
    quantizers take float32, bfloat16 and float16), always stay in high precision. Otherwise
    `module_filter_fn(module, fqn) -> bool`, when given, decides; without it layers with
    min(in_features, out_features) < min_features (default 1024) stay (too small to gain).
    Giving both is refused: the filter alone would decide, ignoring min_features. Returns,
    and logs, which layers were converted and why the others were kept. `model` may itself be
    an nn.Linear: it is converted in place too, reported under the name "" (its fqn).
    An nn.Linear whose parent never calls it but hands its weight to a fused op
    (nn.LinearCrossEntropyLoss's, a plain nn.Linear set as an nn.MultiheadAttention's out_proj)
    stays, with the reason in the report; so does one whose forward was replaced on the module
    itself (accelerate's hooks), which would keep calling nn.Linear's. Each low precision layer
    has a no-op forward pre-hook so that an nn.TransformerEncoderLayer's eval fast path, which
    would bypass its linear1 and linear2, stays off (and an nn.TransformerEncoder holding them
    stops making nested tensors).
    """
    r, layer_cls, multiple = _resolve(recipe)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if module_filter_fn is not None and min_features is not None:
        raise ValueError(f"convert() got both module_filter_fn and min_features={min_features}: "
                         f"module_filter_fn decides alone, min_features would be ignored; put the "
                         f"size rule in the filter (min(mod.in_features, mod.out_features) >= "
                         f"{min_features}) or pass only min_features")
    if min_features is None:
        min_features = DEFAULT_MIN_FEATURES
    if min_features < 0:
        raise ValueError(f"min_features must be >= 0, got {min_features}")
    if hasattr(model, "_tierlift_zero"):
        # shard() already replaced the Linear weights by views of its flat buffers and hooked
        # the modules it found; swapping modules now would bypass that.
        raise ValueError("model is already sharded by tierlift.zero.shard: call "
                         "tierlift.lowp.convert(model, ...) before shard() (under python -m "
                         "tierlift.hf.launch, whose partitioned load returns the model "
                         "sharded, set \"from_pretrained\": \"whole\" in its config so the "
                         "script converts before the Trainer shards)")
    report = ConversionReport(recipe=r.name)
    chosen = []  # decided for every layer before any changes (module_filter_fn may raise)
    bypassed = _bypassed_linears(model)
    for name, mod in model.named_modules():  # a module at several paths comes once
        if isinstance(mod, (Float8Linear, FP4Linear)):
            report.already_converted[name] = f"{type(mod).__name__} ({mod.recipe.name})"
            continue
        if not isinstance(mod, nn.Linear):
            continue
        if type(mod) is not nn.Linear:  # MultiheadAttention reads out_proj.weight, not its forward
            report.skipped[name] = (_PARAMETRIZED if _parametrized_linear(mod) else
                                    f"a subclass of nn.Linear ({type(mod).__name__})")
            continue
        if id(mod) in bypassed:
            report.skipped[name] = bypassed[id(mod)]
            continue
        if "forward" in vars(mod):
            report.skipped[name] = _INSTANCE_FORWARD
            continue
        why = _skip_reason(name, mod, module_filter_fn, min_features, multiple)
        if why is not None:
            report.skipped[name] = why
        else:
            chosen.append(name)
    for name in chosen:
        _swap_class(model.get_submodule(name), layer_cls, r)
    _keep_encoder_layers_off_their_fused_path(model)
    report.converted = chosen
    log.info("%s", report)
    return report


# accelerate's add_hook_to_module (dispatch_model, device_map with offload) sets the instance's
# forward to a wrapper around the bound nn.Linear.forward it saved: swapping the class would not
# reach it, so the layer would be reported converted and still run in high precision.
_INSTANCE_FORWARD = ("its forward is replaced on the module itself (an accelerate hook or another "
                     "wrapper), which may keep calling the nn.Linear forward it saved: convert "
                     "before adding such hooks (accelerate's dispatch_model, a device_map with "
                     "offload)")


# torch's parametrize swaps the class for a generated subclass, which convert cannot swap again
# without dropping the parametrization; the other order keeps both
_PARAMETRIZED = ("parametrized (torch.nn.utils.parametrize: parametrizations.weight_norm, "
                 "spectral_norm, orthogonal, ...): convert before registering the "
                 "parametrization, which a converted layer keeps and runs")


def _parametrized_linear(mod: nn.Module) -> bool:
    return parametrize.is_parametrized(mod) and type(mod).__bases__ == (nn.Linear,)


def _bypassed_linears(model: nn.Module) -> dict[int, str]:
    """id -> why, for the nn.Linear children whose parent never calls their forward but hands
    their weight to a fused op: a low precision class there would be ignored, the layer reported
    converted while it runs in high precision."""
    readers = [(nn.MultiheadAttention, "out_proj", "F.multi_head_attention_forward")]
    fused_loss = getattr(nn, "LinearCrossEntropyLoss", None)  # newer torch only
    if fused_loss is not None:
        readers.append((fused_loss, "linear", "F.linear_cross_entropy"))
    found = {}
    for mod in model.modules():
        for cls, attr, op in readers:
            child = getattr(mod, attr, None) if isinstance(mod, cls) else None
            if isinstance(child, nn.Linear):
                found[id(child)] = (f"{type(mod).__name__}.{attr}: its parent hands the weight to "
                                    f"{op}, never calling its forward")
    return found


def _keep_encoder_layers_off_their_fused_path(model: nn.Module) -> None:
    """Each low precision layer carries a no-op pre-hook that keeps nn.TransformerEncoderLayer
    off its eval fast path (which would bypass linear1/linear2); given here too to layers
    converted by a tierlift without it (pickled). nn.TransformerEncoder skips nested tensors:
    they would reach those layers, which take dense inputs only."""
    low = (Float8Linear, FP4Linear)
    for mod in model.modules():
        if isinstance(mod, low):
            keep_off_fused_paths(mod)
    for mod in model.modules():
        if isinstance(mod, nn.TransformerEncoder) and getattr(mod, "use_nested_tensor", False):
            if any(isinstance(m, low) for m in mod.modules()):
                mod.use_nested_tensor = False


def _swap_class(mod: nn.Linear, layer_cls: type, recipe) -> None:
    """Make `mod` itself the low-precision layer, as torch's parametrize does: a new module
    would drop its hooks (weight_norm's too), buffers and attributes set on it, its training flag
    and every other path or reference to it, all silently."""
    mod.__class__ = layer_cls
    mod.recipe = recipe
    keep_off_fused_paths(mod)
    if layer_cls is Float8Linear:
        mod.gathered_weight_fn = None
        delayed.attach(mod, recipe, mod.weight.device)
