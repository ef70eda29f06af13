"""A causal-LM training loop written the Accelerate way (Accelerator, prepare, accumulate,
backward, clip_grad_norm_, save_model), with no tierlift in it: test_hf_launch.py runs it
unmodified under `python -m tierlift.hf.launch` and plainly in one process. Token ids come
from a seeded generator; the losses go to OUT/losses.json.

    python hf_stock_accelerate.py MODEL_DIR OUT BATCH
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, get_constant_schedule

STEPS, ACCUM, LR, CLIP = 4, 2, 3e-3, 0.5


def main(model_dir: str, out: str, batch: int) -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.randint(0, model.config.vocab_size, (64, 16),
                        generator=torch.Generator().manual_seed(3))
    loader = torch.utils.data.DataLoader(ids, batch_size=batch, shuffle=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    # Constant: accelerate steps a prepared scheduler once per process, so a decaying one would
    # not match a one-process run (by accelerate's design, not the sharding's).
    sched = get_constant_schedule(opt)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    model.train()
    losses, total, step = {}, 0.0, 0
    for x in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=x, labels=x).loss
            accelerator.backward(loss)
            total += accelerator.reduce(loss.detach(), "mean").item() / ACCUM
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            sched.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            losses[step], total = total, 0.0
            if step == STEPS:
                break
    accelerator.save_model(model, out)
    if accelerator.is_main_process:
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump(losses, f)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
