"""python -m tierlift.checkpoint export CKPT_DIR OUT(.pt|.safetensors): a plain state dict.
python -m tierlift.checkpoint export-optimizer CKPT_DIR OUT.pt: the optimizer state of an
unsharded model's checkpoint (offloaded or not) as torch.optim.AdamW.load_state_dict takes it."""

from __future__ import annotations

import argparse

import torch

from tierlift.checkpoint.format import full_state_dict
from tierlift.checkpoint.replicated import optimizer_state_dict


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierlift.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="write the unsharded model state dict of a checkpoint")
    exp.add_argument("checkpoint", help="checkpoint directory written by tierlift.checkpoint.save")
    exp.add_argument("out", help="output file: .pt (torch.save) or .safetensors")
    opt = sub.add_parser("export-optimizer",
                         help="write the optimizer state dict (torch.optim format) of an "
                              "unsharded model's checkpoint")
    opt.add_argument("checkpoint", help="checkpoint directory written by tierlift.checkpoint.save")
    opt.add_argument("out", help="output file (torch.save)")
    args = parser.parse_args(argv)
    if args.command == "export-optimizer":
        sd = optimizer_state_dict(args.checkpoint)
        torch.save(sd, args.out)
        print(f"wrote the state of {len(sd['state'])} parameters to {args.out}")
        return 0
    sd = full_state_dict(args.checkpoint)
    if args.out.endswith(".safetensors"):
        try:
            from safetensors.torch import save_file
        except ImportError:
            parser.error("writing .safetensors needs the safetensors package "
                         "(pip install safetensors); or write a .pt file")
        # safetensors refuses shared storage: tied weights are written once per name.
        save_file({k: v.contiguous().clone() for k, v in sd.items()}, args.out)
    else:
        torch.save(sd, args.out)
    print(f"wrote {len(sd)} tensors to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
