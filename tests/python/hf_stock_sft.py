"""A supervised fine-tuning script shaped like TRL's trl/scripts/sft.py (TrlParser, SFTConfig,
ModelConfig, SFTTrainer given the model's name, so TRL calls from_pretrained itself), with no
tierlift in it: test_hf_launch.py runs it unmodified under `python -m tierlift.hf.launch` and
plainly in one process. The dataset is pre-tokenized rows from a seeded generator (sft.py
loads a Hub dataset; nothing is downloaded here).

    python hf_stock_sft.py --model_name_or_path DIR --output_dir OUT --use_cpu ...
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from datasets import Dataset
from trl import ModelConfig, SFTConfig, SFTTrainer, TrlParser


@dataclass
class ScriptArguments:
    num_rows: int = field(default=64, metadata={"help": "Training rows."})
    row_length: int = field(default=16, metadata={"help": "Tokens per row."})
    vocab: int = field(default=64, metadata={"help": "Token ids are drawn below this."})


def main(script_args, training_args, model_args):
    training_args.model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, script_args.vocab, (script_args.num_rows, script_args.row_length),
                        generator=g)
    dataset = Dataset.from_dict({"input_ids": ids.tolist()})

    trainer = SFTTrainer(model=model_args.model_name_or_path, args=training_args,
                         train_dataset=dataset)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    main(script_args, training_args, model_args)
