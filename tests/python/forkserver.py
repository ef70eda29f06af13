"""The one fork server of the tests that fork children (killed mid-write on purpose, ...).

Children fork from a clean server process that has imported torch and tierlift (fast, and free
of the threads other tests leave in the pytest process, which a plain fork would inherit
broken). torch._dynamo too: torch.optim imports it on the first optimizer built, 3-5 s that
every child would pay again. pytest too: each child imports the parent's main module (pytest's
__main__) again, which imports pytest itself. multiprocessing keeps one server per process,
started with the last preload list set before it starts, so every module that forks uses this
one list (it names each of them, so their functions unpickle without an import)."""

from __future__ import annotations

import multiprocessing

CTX = multiprocessing.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "torch._dynamo", "tierlift", "pytest",
                            "test_offload_durable", "test_offload_durable_refusals"])
