"""transformers' own Trainer, as it was before tierlift.hf.launch put a subclass of
tierlift.hf.Trainer at transformers.Trainer (and transformers.trainer.Trainer): the stock rules
(the weight-decay split) stay reachable under the launch. tierlift.hf.trainer imports this module
first, so it is read before any such replacement."""

from __future__ import annotations

import transformers

StockTrainer = transformers.Trainer
