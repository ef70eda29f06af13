"""The no-code-change route: a stock training script trains with tierlift.zero as it stands.

    torchrun --nproc-per-node 8 -m tierlift.hf.launch --config zero.json run_clm.py ...
    TIERLIFT_HF_CONFIG=zero.json torchrun --nproc-per-node 8 -m tierlift.hf.launch sft.py ...

Each worker reads the config file (config_file.py), installs the route, then runs the script as
`__main__` (runpy, sys.argv set to the script's). The route replaces, in this process only:
  transformers.Trainer (and transformers.trainer.Trainer)  by a tierlift.hf.Trainer subclass
      taking the file's ZeroConfig; subclasses the script or a library defines afterwards (TRL's
      SFTTrainer, Seq2SeqTrainer) inherit it. A `zero=` argument is refused: the file says it.
  accelerate.Accelerator  by tierlift.hf.Accelerator (the same for unsharded models).
  PreTrainedModel.from_pretrained (so AutoModel*.from_pretrained too), unless the file says
      "from_pretrained": "whole": tierlift.hf.from_pretrained, which reads each rank's slices
      of the safetensors files into shards with the Trainer's weight-decay split (pretrained.py).
      Every model the script loads so is sharded, and its forward is a collective.
Nothing is replaced by importing tierlift or tierlift.hf: only install() (which the launcher
calls) does it, and uninstall() puts everything back.
"""

from __future__ import annotations

import os
import runpy
import sys

from tierlift.hf.config_file import LaunchConfig, load_config

ENV = "TIERLIFT_HF_CONFIG"
_SAVED: dict = {}  # (owner, attribute) -> the original, while the route is installed

USAGE = ("usage: python -m tierlift.hf.launch [--config FILE] (SCRIPT.py | -m MODULE) [ARGS...]"
         f"\n  (under torchrun; FILE: JSON or YAML of ZeroConfig fields, or ${ENV})")


def route_trainer(config: LaunchConfig):
    """The class that stands for transformers.Trainer: tierlift.hf.Trainer with the file's
    ZeroConfig (zero=None for a model that tierlift.hf.from_pretrained sharded already)."""
    from tierlift.hf import model as zmodel
    from tierlift.hf.trainer import Trainer as ZeroTrainer

    class Trainer(ZeroTrainer):
        __doc__ = ("transformers.Trainer under tierlift.hf.launch: tierlift.hf.Trainer with the "
                   "config file's ZeroConfig.\n\n" + (ZeroTrainer.__doc__ or ""))

        def __init__(self, model=None, args=None, *pos, **kw):
            if "zero" in kw:
                raise TypeError("under tierlift.hf.launch the ZeroConfig comes from the config "
                                "file: drop zero= (or run the script without the launcher)")
            sharded = model is not None and zmodel.is_sharded(model)
            super().__init__(model, args, *pos, zero=None if sharded else config.zero, **kw)

    return Trainer


def _partitioned_from_pretrained(config: LaunchConfig):
    from tierlift.hf.pretrained import from_pretrained as load

    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        if model_args:
            raise TypeError("from_pretrained(path, *model_args): positional model arguments "
                            "are not taken under tierlift.hf.launch; pass them as keywords")
        return load(pretrained_model_name_or_path, config.zero, model_class=cls, **kwargs)

    return classmethod(from_pretrained)


def _replace(owner, name: str, value) -> None:
    _SAVED[(owner, name)] = owner.__dict__[name]
    setattr(owner, name, value)


def install(config: LaunchConfig) -> None:
    """Puts the route in place in this process (see the module doc)."""
    import accelerate
    import accelerate.accelerator
    import transformers
    import transformers.trainer
    from transformers import PreTrainedModel

    from tierlift.hf.accelerator import Accelerator

    if not isinstance(config, LaunchConfig):
        raise TypeError(f"install() takes a LaunchConfig (load_config(path)), got "
                        f"{type(config).__name__}")
    if _SAVED:
        raise RuntimeError("the tierlift.hf route is installed already (uninstall() first)")
    _ = transformers.Trainer  # the lazy module resolves it, so its __dict__ holds it
    trainer = route_trainer(config)
    _replace(transformers.trainer, "Trainer", trainer)
    # The lazy top-level module can be replaced in sys.modules on a first attribute access
    # (seen under pytest); the script imports whichever is there when it starts.
    top = sys.modules["transformers"]
    _ = top.Trainer
    _replace(top, "Trainer", trainer)
    _ = accelerate.Accelerator
    _replace(accelerate, "Accelerator", Accelerator)
    _replace(accelerate.accelerator, "Accelerator", Accelerator)
    if config.from_pretrained == "partitioned":
        _replace(PreTrainedModel, "from_pretrained", _partitioned_from_pretrained(config))


def uninstall() -> None:
    """Puts back what install() replaced."""
    while _SAVED:
        (owner, name), value = _SAVED.popitem()
        setattr(owner, name, value)


def run_script(target: str, argv: list[str], *, module: bool = False) -> None:
    """Runs a script (or `python -m` module) as `__main__` with sys.argv = [target, *argv],
    as `python target argv...` would (the script's folder first on sys.path)."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    try:
        if module:
            sys.argv = [target, *argv]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *argv]
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def parse_argv(argv: list[str], environ=os.environ) -> tuple[str, str, bool, list[str]]:
    """(config file, script or module, whether a module, the script's arguments); the
    launcher's own options come before the script, everything after it is the script's."""
    config, i = None, 0
    while i < len(argv) and argv[i].startswith("--config"):
        if argv[i] == "--config" and i + 1 < len(argv):
            config, i = argv[i + 1], i + 2
        elif argv[i].startswith("--config="):
            config, i = argv[i].split("=", 1)[1], i + 1
        else:
            raise SystemExit(USAGE)
    module = i < len(argv) and argv[i] == "-m"
    i += module
    if i >= len(argv) or argv[i].startswith("-"):
        raise SystemExit(USAGE)
    config = config or environ.get(ENV)
    if not config:
        raise SystemExit(f"tierlift.hf.launch: no config file (--config FILE or ${ENV})\n{USAGE}")
    return config, argv[i], module, argv[i + 1:]


def main(argv: list[str] | None = None) -> None:
    config_path, target, module, rest = parse_argv(sys.argv[1:] if argv is None else argv)
    config = load_config(config_path)  # refused before the script starts
    install(config)
    run_script(target, rest, module=module)
