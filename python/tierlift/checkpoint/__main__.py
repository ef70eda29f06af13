"""python -m tierlift.checkpoint export CKPT_DIR OUT(.pt|.safetensors): a plain state dict."""

from __future__ import annotations

import argparse

import torch

from tierlift.checkpoint.format import full_state_dict


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tierlift.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="write the unsharded model state dict of a checkpoint")
    exp.add_argument("checkpoint", help="checkpoint directory written by tierlift.checkpoint.save")
    exp.add_argument("out", help="output file: .pt (torch.save) or .safetensors")
    args = parser.parse_args(argv)
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
