"""The registry of live sharded models read while another thread shards a model (or a sharded
model is collected): a copy of it must not raise."""

from __future__ import annotations

import gc
import sys
import threading

from torch import nn

from tierlift.zero import members


class _State:  # stands in for a ZeroState: the registry only holds weak references
    pass


def test_live_states_while_another_thread_adds_and_drops():
    held = [_State() for _ in range(2000)]  # a long copy: many thread switches inside it
    for one in held:
        members.STATES.add(one)
    del one
    module = nn.Module()
    stop = threading.Event()

    def shard_and_drop():
        added = []
        while not stop.is_set():
            added.append(_State())
            members.add(module, added[-1])
            if len(added) > 100:
                added.clear()  # collected: dropped from the registry by weakref callbacks

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=shard_and_drop)
    thread.start()
    try:
        for _ in range(100):
            assert all(s is not None for s in members.live_states())
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(switch)
        del held
        gc.collect()
    assert not any(isinstance(s, _State) for s in members.live_states())
