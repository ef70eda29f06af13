"""A causal-LM fine-tuning script shaped like transformers' examples/pytorch/language-modeling/
run_clm.py (HfArgumentParser, from_pretrained, Trainer, resume, save_model, metrics), with no
tierlift in it: test_hf_launch.py runs it unmodified, under `python -m tierlift.hf.launch` on 2
ranks and plainly in one process. The data are token ids drawn from a seeded generator (run_clm
tokenizes a text dataset into blocks; nothing is downloaded here).

    python hf_stock_clm.py --model_name_or_path DIR --output_dir OUT --do_train --use_cpu ...
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "A folder save_pretrained wrote."})
    torch_dtype: str | None = field(default=None, metadata={"help": "auto, float32, ..."})


@dataclass
class DataTrainingArguments:
    num_rows: int = field(default=64, metadata={"help": "Training rows."})
    block_size: int = field(default=16, metadata={"help": "Tokens per row."})
    data_seed_value: int = field(default=3, metadata={"help": "Seed of the token ids."})


class TokenBlocks(torch.utils.data.Dataset):
    def __init__(self, rows: int, block: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (rows, block), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        handlers=[logging.StreamHandler(sys.stdout)])
    transformers.utils.logging.set_verbosity(training_args.get_process_log_level())

    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
    set_seed(training_args.seed)

    dtype = (model_args.torch_dtype if model_args.torch_dtype in ("auto", None)
             else getattr(torch, model_args.torch_dtype))
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=dtype)
    # run_clm resizes the embeddings when the tokenizer outgrew them; here it never has.
    embedding_size = model.get_input_embeddings().weight.shape[0]
    if model.config.vocab_size > embedding_size:
        model.resize_token_embeddings(model.config.vocab_size)

    train_dataset = TokenBlocks(data_args.num_rows, data_args.block_size,
                                model.config.vocab_size, data_args.data_seed_value)
    trainer = Trainer(model=model, args=training_args,
                      train_dataset=train_dataset if training_args.do_train else None,
                      data_collator=default_data_collator)
    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint or last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()


if __name__ == "__main__":
    main()
