"""tierlift.hf.from_pretrained: a Hugging Face checkpoint loaded straight into ZeRO shards.

    model = tierlift.hf.from_pretrained("path/or/name", zero=tierlift.hf.ZeroConfig(stage=3))
    trainer = tierlift.hf.Trainer(model=model, args=args, train_dataset=data)  # zero=None

The model is built on the meta device (accelerate's init_empty_weights: parameters on meta,
buffers such as rotary tables real), then tierlift.zero.shard(weights=folder) reads each rank's
byte ranges of the safetensors files (stage 3; stages 1/2 keep whole weights on every rank
anyway). Peak host memory per rank is its shards plus one read, never the whole model.

The units are split by the Trainer's weight-decay rule (get_decay_parameter_names, computed on
the meta model, which has the real names, shapes and module types), under the keys "decay" /
"no_decay": tierlift.hf.Trainer given this model (zero=None) builds its usual two AdamW groups
from them, and takes the ZeroConfig's optimizer and checkpoint options from the model.

What plain from_pretrained does differently: trainable weights are fp32 master shards whatever
the checkpoint's dtype (compute in bf16 with ZeroConfig(mixed_precision=...)); the checkpoint's
names must be the model's (as save_pretrained of the same class writes them: no base-model
prefix added or stripped, no legacy renames); options that place or quantize weights
(device_map, quantization_config, tp_plan, ...) are refused.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from tierlift.hf.config import ZeroConfig
from tierlift.hf.model import install

# from_pretrained options: used to find the files, or with nothing to do for a sharded load.
_HUB = ("cache_dir", "force_download", "local_files_only", "token", "revision", "proxies")
_NOTHING_TO_DO = ("low_cpu_mem_usage", "weights_only", "_from_auto", "_from_pipeline",
                  "_commit_hash", "trust_remote_code", "disable_mmap", "code_revision",
                  "adapter_name")
# Options that place, quantize or rename weights: a sharded load cannot honour them.
_REFUSED = ("device_map", "max_memory", "offload_folder", "offload_buffers",
            "quantization_config", "state_dict", "gguf_file", "tp_plan", "tp_size",
            "device_mesh", "distributed_config", "key_mapping", "variant",
            "ignore_mismatched_sizes", "output_loading_info", "use_kernels")
DECAY, NO_DECAY = "decay", "no_decay"
_MARK = "_tierlift_hf_zero"  # the ZeroConfig a model was loaded with


def zero_of(model) -> ZeroConfig | None:
    """The ZeroConfig tierlift.hf.from_pretrained sharded `model` with (None otherwise)."""
    return getattr(model, _MARK, None)


def _init_process_group() -> None:
    """Under torchrun with no process group yet (the script builds TrainingArguments after
    from_pretrained): start it as accelerate would, rather than shard over one rank."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        from accelerate import PartialState

        PartialState()


def _folder(name_or_path, hub: dict, subfolder: str) -> str:
    path = os.path.join(os.fspath(name_or_path), subfolder)
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download

    root = snapshot_download(os.fspath(name_or_path), allow_patterns=["*.json", "*.safetensors"],
                             **{k: v for k, v in hub.items() if k != "proxies"})
    return os.path.join(root, subfolder)


def _model_class(cls, config):
    from transformers import PreTrainedModel
    from transformers.models.auto.auto_factory import _get_model_class

    if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
        return cls
    mapping = getattr(cls, "_model_mapping", None)
    if mapping is None or type(config) not in mapping:
        raise ValueError(f"{getattr(cls, '__name__', cls)} has no model class for "
                         f"{type(config).__name__}")
    return _get_model_class(config, mapping)


def decay_split(model):
    """param_group_fn giving the Trainer's weight-decay groups: "decay" for the names
    transformers.Trainer.get_decay_parameter_names returns, "no_decay" for the rest."""
    # the stock method (it reads nothing from self), not the one under transformers.Trainer:
    # under tierlift.hf.launch that is tierlift's, which names shards of a sharded model
    from tierlift.hf.stock import StockTrainer

    return decay_keys(StockTrainer.get_decay_parameter_names(None, model))


def decay_keys(decay_names):
    """param_group_fn putting the parameters named in `decay_names` under "decay", the rest
    under "no_decay" (the keys tierlift.hf.Trainer builds its two AdamW groups from)."""
    decay = set(decay_names)
    return lambda name, _: DECAY if name in decay else NO_DECAY


def head_in_root(model, zero: ZeroConfig) -> dict:
    """units= keeping the output embedding (the LM head) in the root unit, which is gathered
    for the whole forward and backward: fused losses (TRL's SFTTrainer, Liger) read
    lm_head.weight from the model's forward without calling the head. {} when
    ZeroConfig.shard_kwargs names the units itself, or the model has no separate head."""
    from tierlift.zero.api import default_units

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if "units" in zero.shard_kwargs or head is None:
        return {}
    names = {id(m): n for n, m in model.named_modules()}
    units = default_units(model, zero.shard_kwargs.get("min_unit_numel"),
                          include_frozen=zero.stage == 3)
    return {"units": [u for u in units if u != names.get(id(head))]}


def from_pretrained(name_or_path, zero: ZeroConfig | None = None, *, model_class=None,
                    device=None, **kwargs):
    """A from_pretrained checkpoint (a local folder or a Hub name) loaded straight into shards
    with `zero` (default ZeroConfig(): stage 3). model_class: a PreTrainedModel subclass or an
    Auto class (default AutoModelForCausalLM). device: where the shards go (default: this
    rank's GPU, else the CPU). kwargs: from_pretrained's (config=, dtype=, attn_implementation=,
    revision=, ..., and config attributes); see the module doc for what differs. Under torchrun
    every rank calls it (a collective)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    zero = ZeroConfig() if zero is None else zero
    if not isinstance(zero, ZeroConfig):
        raise TypeError(f"zero must be a tierlift.hf.ZeroConfig, got {type(zero).__name__}")
    for key in ("weights", "device"):
        if key in zero.shard_kwargs:
            raise ValueError(f"ZeroConfig.shard_kwargs[{key!r}] is set by from_pretrained "
                             "(the checkpoint folder and device=); drop it")
    for key in _REFUSED:
        if kwargs.get(key) not in (None, False, {}, ""):
            raise ValueError(f"from_pretrained({key}=...) places, quantizes or renames weights, "
                             "which a load into tierlift.zero shards cannot do; drop it "
                             "(the shards go where ZeroConfig and device= say)")
        kwargs.pop(key, None)
    if "_adapter_model_path" in (kwargs.pop("adapter_kwargs", None) or {}):
        raise ValueError(f"{name_or_path} holds a peft adapter: load its base model, add the "
                         "adapter, then shard (the launcher's \"from_pretrained\": \"whole\")")
    if kwargs.get("use_safetensors") is False:
        raise ValueError("use_safetensors=False: a sharded load reads safetensors files only")
    kwargs.pop("use_safetensors", None)
    hub = {k: kwargs.pop(k) for k in _HUB if k in kwargs}
    trust = kwargs.get("trust_remote_code")
    for key in _NOTHING_TO_DO:
        kwargs.pop(key, None)
    dtype = kwargs.pop("dtype", None)
    torch_dtype = kwargs.pop("torch_dtype", None)
    dtype = torch_dtype if dtype is None else dtype
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    if isinstance(dtype, torch.dtype) and dtype != torch.float32 and zero.mixed_precision is None:
        warnings.warn(f"from_pretrained(dtype={dtype}): tierlift keeps fp32 master shards and "
                      "computes in fp32 without ZeroConfig(mixed_precision=...); set "
                      "mixed_precision to compute in a lower precision", stacklevel=2)
    attn = kwargs.pop("attn_implementation", None)
    generation_config = kwargs.pop("generation_config", None)
    folder = _folder(name_or_path, hub, kwargs.pop("subfolder", "") or "")
    config = kwargs.pop("config", None)
    if config is None or isinstance(config, (str, os.PathLike)):
        config = AutoConfig.from_pretrained(folder if config is None else config,
                                            trust_remote_code=trust)
    for key, value in kwargs.items():  # the rest sets config attributes, as in transformers
        if not hasattr(config, key):
            raise TypeError(f"from_pretrained got an option {key!r} that is neither one it "
                            f"takes nor an attribute of {type(config).__name__}")
        setattr(config, key, value)
    config.name_or_path = os.fspath(name_or_path)
    cls = _model_class(AutoModelForCausalLM if model_class is None else model_class, config)
    _init_process_group()
    if device is None:
        device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                  if torch.cuda.is_available() else torch.device("cpu"))
    with init_empty_weights():  # parameters on meta; buffers (rotary tables) real, on the CPU
        model = cls._from_config(config, dtype=torch.float32,
                                 **({} if attn is None else {"attn_implementation": attn}))
    model.tie_weights()  # init_empty_weights leaves tied weights as two meta tensors
    zero.shard(model, param_group_fn=decay_split(model), device=device, weights=folder,
               **head_in_root(model, zero))
    setattr(model, _MARK, zero)
    # save_pretrained writes the gathered weights (not the flat shards), generate() is synced
    # across ranks, as for the models tierlift.hf.Trainer and Accelerator.prepare shard.
    install(model)
    if generation_config is not None:
        model.generation_config = generation_config
    elif model.can_generate() and os.path.isfile(os.path.join(folder,
                                                                "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(folder)
    model.eval()  # as from_pretrained leaves it (Trainer.train() switches to train mode)
    return model
