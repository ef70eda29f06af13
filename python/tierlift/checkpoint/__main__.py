"""python -m tierlift.checkpoint export CKPT_DIR OUT(.pt|.safetensors): a plain state dict.
python -m tierlift.checkpoint export CKPT_DIR OUT_DIR --format hf [--max-shard-size 5GB]
[--config config.json]: Hugging Face sharded safetensors, for from_pretrained(OUT_DIR).
python -m tierlift.checkpoint import-dcp DCP_DIR OUT_CKPT [--prefix model.]: the model weights
of a torch.distributed.checkpoint as a tierlift checkpoint (handoff.py).
python -m tierlift.checkpoint export-optimizer CKPT_DIR OUT.pt: the optimizer state of an
unsharded model's checkpoint (offloaded or not) as torch.optim.AdamW.load_state_dict takes it.

Every command writes only to a new path (or, for a directory, an empty one) and creates its
missing parent directories; a bad argument, or a write that fails (a missing or read-only
folder, a full drive, a file size limit), is a one-line error naming the path and the cause,
and nothing is left at the output (outputs.py). A checkpoint without manifest.json is refused
unless --allow-unverified-json is given (a checkpoint from a tierlift before manifests: its
JSON files, hyperparameters and step counts, are then not checked)."""

from __future__ import annotations

import argparse
import os

import torch

from tierlift.checkpoint import handoff, outputs, targets
from tierlift.checkpoint.format import full_state_dict
from tierlift.checkpoint.replicated import optimizer_state_dict
from tierlift.io.fsync import fsync_path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierlift.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="write the unsharded model state dict of a checkpoint")
    exp.add_argument("checkpoint", help="checkpoint directory written by tierlift.checkpoint.save")
    exp.add_argument("out", help="output file: .pt (torch.save) or .safetensors; with "
                                 "--format hf, a new or empty directory")
    exp.add_argument("--format", choices=["file", "hf"], default="file",
                     help="file (default): one state dict file; hf: Hugging Face sharded "
                          "safetensors with model.safetensors.index.json")
    exp.add_argument("--max-shard-size",
                     help="--format hf: the most bytes per file, e.g. 500MB, 2GiB (default "
                          "5GB)")
    exp.add_argument("--config", help="--format hf: a config.json to copy into OUT, so "
                                      "from_pretrained(OUT) finds it")
    imp = sub.add_parser("import-dcp", help="write the model weights of a "
                                            "torch.distributed.checkpoint as a tierlift "
                                            "checkpoint")
    imp.add_argument("dcp", help="directory written by torch.distributed.checkpoint.save")
    imp.add_argument("out", help="tierlift checkpoint directory to write")
    imp.add_argument("--prefix", default="",
                     help="import only the tensors whose names start with this, without it "
                          "(e.g. model. for dcp.save({'model': ..., 'optim': ...}))")
    opt = sub.add_parser("export-optimizer",
                         help="write the optimizer state dict (torch.optim format) of an "
                              "unsharded model's checkpoint")
    opt.add_argument("checkpoint", help="checkpoint directory written by tierlift.checkpoint.save")
    opt.add_argument("out", help="output file (torch.save)")
    for p in (exp, opt):
        p.add_argument("--allow-unverified-json", action="store_true",
                       help="accept a checkpoint without manifest.json (written before "
                            "tierlift had manifests): its JSON files (hyperparameters, step "
                            "counts, shapes) then go unchecked, so a changed value is read "
                            "as it is")
    args = parser.parse_args(argv)
    if args.command == "export" and args.format != "hf" and (
            args.max_shard_size is not None or args.config is not None):
        parser.error("--max-shard-size and --config go with --format hf")
    try:
        return _run(args)
    except (OSError, ImportError, ValueError) as e:  # one line, no traceback
        parser.error(str(e))


def _torch_save(obj, file: str) -> None:
    """torch.save into a Python file: a failed write's OSError (a full drive, a file size
    limit) stays beneath torch's own error, for outputs.write_new to name."""
    with open(file, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _run(args) -> int:
    if args.command == "export-optimizer":
        sd = optimizer_state_dict(args.checkpoint, verify=not args.allow_unverified_json)
        outputs.write_new(args.out, lambda tmp: _torch_save(sd, tmp))
        print(f"wrote the state of {len(sd['state'])} parameters to {args.out}")
        return 0
    if args.command == "import-dcp":
        n = handoff.import_dcp(args.dcp, args.out, prefix=args.prefix)
        print(f"wrote {n} tensors to {args.out}")
        print(handoff.DCP_NOTE)
        return 0
    if args.format == "hf":
        files, n, total = handoff.export_hf(args.checkpoint, args.out,
                                            max_shard_size=args.max_shard_size or "5GB",
                                            config=args.config,
                                            verify=not args.allow_unverified_json)
        print(f"wrote {n} tensors ({total} bytes) in {files} file(s) to {args.out}")
        return 0
    targets.check_new_output(args.out)  # before reading the checkpoint
    if args.out.endswith(".safetensors"):
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ImportError("writing .safetensors needs the safetensors package "
                              "(pip install safetensors); or write a .pt file") from None
    sd = full_state_dict(args.checkpoint, verify=not args.allow_unverified_json)
    if args.out.endswith(".safetensors"):
        # safetensors refuses shared storage: tied weights are written once per name.
        def write(tmp: str) -> None:
            save_file({k: v.contiguous().clone() for k, v in sd.items()}, tmp)
            fsync_path(tmp)

        outputs.write_new(args.out, write)
    else:
        outputs.write_new(args.out, lambda tmp: _torch_save(sd, tmp))
    print(f"wrote {len(sd)} tensors to {args.out}")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
