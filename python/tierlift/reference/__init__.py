"""Pure-torch references of every tierlift kernel, used by the tests and as the fallback when
the compiled extension is missing. Each mirrors its kernel's arithmetic order."""

from tierlift.reference.optim import adam_step_
from tierlift.reference.zero import flatten_pack_, unflatten_

__all__ = ["adam_step_", "flatten_pack_", "unflatten_"]
