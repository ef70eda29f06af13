"""Offloader: the step of tierlift.optim.Adam/AdamW with optimizer state in host memory or on
NVMe. The optimizer keeps torch's param groups and its per-parameter "step" counts; this class
owns master weights, exp_avg, exp_avg_sq (and max_exp_avg_sq) in flat per-group tiers and runs
the fused SIMD CPU Adam chunk by chunk; with state_dtype="bf16" the tiers hold compact state
(bf16 exp_avg, uint8 exp_avg_sq codes, exp_avg_sq_scale) and the compact kernel steps it.

NVMe pipeline, per param group (S pool slots, 6 by default, each holding one chunk of every
state kind): chunks k+1 .. k+S-2 are read while chunk k is stepped and the chunks before it are
written back; the first S-1 reads start before the gradient check. All buffers come from the
io engine's pool of `cpu_budget` bytes, allocated once, so the host memory the optimizer holds
never exceeds the budget. A step is all-or-nothing: an I/O failure puts the parameters back from
the committed master weights; inf/NaN gradients are stepped as torch steps them unless a
GradScaler found them or skip_nonfinite=True asked to skip such steps (nothing changes then).

Host memory with two generations (offload="cpu", overlap=True): no pipeline; the kernel reads a
chunk's generation g and writes g + 1 where they lie (_run_direct), and the slots only stage
device gradients and weights. Under a cpu_budget below two generations the host tier keeps one
generation and spare blocks (sizing.spare_chunks, tiers.MemoryTier): the overlap steps chunks ahead
into spare blocks, step() steps the others in place after the rest is published.

A chunk's kernel step itself (staging, the SIMD Adam, publishing the weights): chunk_step.py.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
import warnings
from collections import defaultdict

import torch

from tierlift._shards import all_ranks_agree, is_shard, shard_owner
from tierlift.io import ChecksumError
from tierlift.offload import d2h, file_tiers, gradients, h2d, legs, masters, scaler_scan, sizing
from tierlift.offload.checks import (
    check_group,
    check_lists,
    check_params,
    check_state_keys,
    check_unchanged,
    formats,
    listed,
    scale_value,
)
from tierlift.offload.chunk_step import ChunkStep
from tierlift.offload.config import OffloadConfig
from tierlift.offload.device_part import DevicePart
from tierlift.offload.device_staging import DeviceStaging
from tierlift.offload.layout import (
    build_layout,
    chunk_bytes,
    kind_slice,
    reserved_elems,
    reserves,
    state_kinds,
)
from tierlift.offload.overlap import Overlap, publish, scan_grads, validate
from tierlift.offload.state_io import StateIO
from tierlift.offload.strided import check_strided, contiguous_data, laid_out_strided
from tierlift.offload.tiers import drain
from tierlift.offload.watch import ParamWatch


class Offloader(StateIO, ChunkStep):
    def __init__(self, optimizer, config: OffloadConfig):
        check_params(optimizer.param_groups)
        self._built = listed(optimizer.param_groups)
        self._formats = formats(optimizer.param_groups)
        self.opt = optimizer
        self.config = config
        self._last_stats: dict = {}
        self.clock = legs.Clock()  # this step's spans, on every thread (last_step_stats["legs"])
        self._engine = None
        self._dir = None
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._zero = any(is_shard(p) for p in params)
        # Parameters whose state stays beside them (device_part.py): no tier space, no chunks.
        self.device_part = DevicePart(optimizer, config.device_fraction)
        # Its kernels' device time: CUDA events around the launch, read once done.
        self._device_time = legs.DeviceTime(sorted(
            {p.device for gi, g in enumerate(optimizer.param_groups)
             for pi, p in enumerate(g["params"])
             if self.device_part.holds(gi, pi) and d2h.on_device(p)}, key=str))
        kept = [[reserves(p) and not self.device_part.holds(gi, pi)
                 for pi, p in enumerate(g["params"])]
                for gi, g in enumerate(optimizer.param_groups)]
        check_strided(optimizer.param_groups)
        # stepped through a contiguous copy, their masters in the tiers (strided.py)
        self._strided = laid_out_strided(optimizer.param_groups)
        self._cuda = any(d2h.on_device(p) for p in params)
        self._copier = d2h.Copier()  # D2H of device gradients, on a copy stream
        self._uploads = h2d.Uploader()  # H2D of new weights from the slots, not waited for
        self._device_staging = None  # the overlap's device shadow of new weights, set below
        self._pin = torch.cuda.is_available()
        self.state_dtype = getattr(optimizer, "_state_dtype", "fp32")
        self._dtypes = [state_kinds(g["amsgrad"], self.state_dtype)
                        for g in optimizer.param_groups]
        self._kinds = [list(d) for d in self._dtypes]
        # NVMe, and host memory with overlap, step chunk by chunk through pipeline slots; the
        # resident host tier without overlap updates the state in place.
        self.streamed = config.offload in ("nvme", "hybrid") or config.overlap
        # An fp32 parameter is its own master (no second copy in the tiers) unless a failed
        # step must put it back (two generations) or a reopen must find it (durable). On the
        # device it is then stepped through a slot (copied down, stepped, copied back): only
        # the streamed step has slots for that.
        self._own_masters = not config.durable and (
            not self.streamed or (config.offload in ("nvme", "hybrid")
                                  and config.nvme_generations == 1))
        # Per group: the kinds its tier holds (no master where every parameter is its own).
        self._tier_kinds = [k if any(self._uses_master(p) for p, keep in zip(g["params"], ks)
                                     if keep) else k[1:]
                            for g, k, ks in zip(optimizer.param_groups, self._kinds, kept)]
        # A slot holds one chunk of every state kind (each 4 KiB aligned), plus fp32 grad and
        # copy staging for GPU params.
        slot_dtypes = dict(max(({k: d[k] for k in tk} for d, tk in
                                zip(self._dtypes, self._tier_kinds)), key=len,
                               default=state_kinds(False)))
        if self._cuda:
            if self.streamed:  # the master of a device parameter that is its own
                slot_dtypes = {"master": torch.float32, **slot_dtypes}
            slot_dtypes.update(grad=torch.float32, copy=torch.float32)
        elif config.durable:  # the gradient log's staging
            slot_dtypes.update(grad=torch.float32)
        self._slot_dtypes = slot_dtypes
        # Frozen parameters get no state (layout.reserves), as torch creates none for them.
        largest = max((reserved_elems([p for p, keep in zip(g["params"], ks) if keep])
                       for g, ks in zip(optimizer.param_groups, kept)), default=0)
        slots, chunk_elems = sizing.slots_and_chunk(config, slot_dtypes, largest)
        self.n_slots, self.chunk_elems = slots, chunk_elems
        self._in_file = [set() for _ in optimizer.param_groups]  # params whose master is stored
        self.layouts = [build_layout(list(g["params"]), chunk_elems, ks)
                        for g, ks in zip(optimizer.param_groups, kept)]
        self._device_staging = DeviceStaging.build(self)  # refuses before any state is made
        self._slot_kinds = list(slot_dtypes)
        self.overlap = None  # Overlap, set last
        self._broken = None  # why step() refuses: an in-place rewrite failed half way
        self.scaler_scan = None  # what GradScaler's check saw (scaler_scan.py), for one step
        self._watch = ParamWatch(len(optimizer.param_groups))
        self._scale_seen = None  # the last step's GradScaler scale: the overlap assumes it
        self._durable = None  # DurableState with durable=True
        self.pool_bytes = 0
        if config.offload == "cpu":
            sizing.build_memory_tiers(self, slots)
        else:
            with self.contiguous_data():  # a durable reopen writes the parameters
                file_tiers.build(self, slots)
        self.overlap = None
        if config.overlap:
            self.overlap = Overlap(self)
            scaler_scan.install()

    # ---- helpers -------------------------------------------------------------------------
    def check_lists(self) -> None:
        """Refuses params lists changed since construction (checks.check_lists)."""
        check_lists(self.opt.param_groups, self._built)

    def check_state(self) -> None:
        """Refuses moments or masters written into optimizer.state, which the tiers hold
        (checks.check_state_keys): before a step or a state_dict() reads the tiers instead."""
        check_state_keys(self.opt, self.layouts, self)

    def _name(self, gi: int, pi: int) -> str:
        return f"param_groups[{gi}]['params'][{pi}]"

    def check_param(self, gi: int, pi: int, p: torch.Tensor) -> None:
        """Refuses a reserved parameter whose data changed since construction
        (checks.check_unchanged)."""
        check_unchanged(self._name(gi, pi), p, self.layouts[gi].numels[pi],
                        *self._formats[gi][pi], strided=id(p) in self._strided)

    def contiguous_data(self, write_back: bool = True):
        """Strided parameters as contiguous copies within (strided.contiguous_data)."""
        return contiguous_data(self.opt.param_groups, self._strided, write_back)

    def _what(self, gi: int, chunk):
        return lambda: ", ".join(self._name(gi, s.pi) for s in chunk.segments)

    def _uses_master(self, p: torch.Tensor) -> bool:
        """Whether the tiers store a master of `p` (else p is its own)."""
        if p.dtype != torch.float32 or not self._own_masters or id(p) in self._strided:
            return True
        return d2h.on_device(p) and not self.streamed

    @property
    def last_step_stats(self) -> dict:
        """The last step's stats; the device part's GPU time lands in them once it is known
        (legs.DeviceTime: read here if its events are done, never waited for)."""
        self._device_time.poll()
        return self._last_stats

    @last_step_stats.setter
    def last_step_stats(self, stats: dict) -> None:
        self._last_stats = stats

    def close(self, join: bool = True) -> None:
        """`join`: wait for the overlap's worker thread to exit (see __del__). Idempotent."""
        if self.overlap is not None:
            self.overlap.close(join)
            self.overlap = None
        self._uploads.drain()  # they read the slots, whose memory goes with the engine
        if self._device_staging is not None:  # after the uploads into it
            self._device_staging.close()
        # No copy reads the host tiers any more: their page-locked memory goes back to the OS
        # now, not when the optimizer is collected (the state stays readable, pageable).
        for tier in getattr(self, "tiers", []):
            tier.unpin()
        if self._engine is not None and not self._engine.closed:
            self._slots = []
            if self._durable is not None:  # the files stay, to be reopened
                for tier in self.tiers:
                    tier.wait_unheld_all()
                self._engine.close()
                self._durable.close()
                return
            for tier in self.tiers:
                tier.remove_files()
            self._engine.close()
            shutil.rmtree(self._dir, ignore_errors=True)

    def __del__(self):
        # The garbage collector may run this while threading holds its shutdown lock (a
        # thread starting); joining the worker then deadlocks. No step runs on it here: queued
        # or running work would keep this object alive.
        try:
            self.close(join=False)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ---- step ----------------------------------------------------------------------------
    @torch.no_grad()
    # Run eagerly under torch.compile(optimizer.step): inductor's graphs of this host code
    # stepped wrongly without an error (weights 25% off torch's after 6 steps, offload="cpu").
    @torch.compiler.disable
    def step(self, grad_scale: torch.Tensor | None = None,
             found_inf: torch.Tensor | None = None) -> None:
        """One step. `grad_scale` / `found_inf`: torch's AMP protocol (GradScaler.step passes
        them to optimizers with _step_supports_amp_scaling): the gradients are still scaled by
        `grad_scale` and the kernel unscales them as it reads them; a nonzero `found_inf`
        skips the step, leaving weights, state and step counts as they were.
        last_step_stats["legs"]: the step (from the forward of its sharded models on) split by
        leg, each with the part the training thread waited for (offload.legs)."""
        training = threading.current_thread().name
        self._device_time.poll()  # the last step's device part, if it is done by now
        try:
            with self.clock.span("other"), self.contiguous_data():
                self._step(grad_scale, found_inf)
            # not through the property: a device time read now would miss the legs
            self._last_stats["legs"] = legs.summarize(self.clock, training,
                                                      self._model_legs())
            if self._device_staging is not None:  # None decides after the first step
                self._device_staging.settle()
        finally:
            self.clock.reset()

    def _model_legs(self) -> list[dict]:
        """ModelLegs.take() of each sharded model that owns some of the parameters."""
        owners = {}
        for p in self._params():
            got = shard_owner(p)
            if got is not None:
                owners[id(got[0])] = got[0]
        return [o.take_legs() for o in owners.values() if hasattr(o, "take_legs")]

    def _step(self, grad_scale, found_inf) -> None:
        seen = scaler_scan.take(self.opt)  # consumed by this step() whatever happens
        if self._broken is not None:
            raise RuntimeError(self._broken)
        self.check_lists()
        self.check_state()
        t0 = time.perf_counter()
        stats = defaultdict(float)
        spec, total, live = {}, None, None
        try:
            if self.overlap is not None:
                spec, total, live = self._take_overlap(stats, grad_scale, found_inf)
            self._step_from(spec, stats, t0, seen, grad_scale, found_inf, total, live)
        finally:  # spare blocks this step did not commit go back (tiers.MemoryTier)
            for tier in self.tiers:
                tier.release_spare()

    def _take_overlap(self, stats, grad_scale, found_inf) -> tuple[dict, object, list]:
        """Waits for the overlap's worker; returns the chunks it stepped ahead (`spec`, as
        finish() gives them), the clip's norm (gradients.norm_ahead, or None) and the collected
        gradients. Before the wait: where this step will be skipped (the scaler found inf/NaN)
        or its gradients clipped, every chunk stepped ahead would be stepped again, so the
        worker leaves the chunks it has not started (a worker behind backward would otherwise
        make step() wait for work it throws away), and step() steps every chunk itself, with
        no fingerprint taken or compared (an empty `spec`)."""
        try:
            live = gradients.collect(self)  # refuses a gradient step() cannot use, first
            scale = None if grad_scale is None else scale_value(grad_scale)
            # taken whatever this rank's found_inf says: under ZeRO the norm is a collective
            total = gradients.norm_ahead(self, scale)
            skipped = (found_inf is not None
                       and float(found_inf.detach().float().sum().item()) != 0.0)
            abandoned = skipped or (total is not None and gradients.clips(self, total))
        except BaseException:
            # refused before anything changed: the chunks stepped ahead go unused
            self.overlap.abandon()
            with contextlib.suppress(BaseException):  # the refusal is the error to see
                self.overlap.finish(stats)
            raise
        if abandoned:
            self.overlap.abandon()
        spec = self.overlap.finish(stats)
        if abandoned:  # stepped again whatever a check finds: not checked at all
            # redone: every chunk taken on during backward, stepped ahead or left
            stats["overlap_redone_chunks"] += (sum(len(v) for v in spec.values())
                                               + stats["overlap_abandoned_chunks"])
            stats["overlap_kept_chunks"] += 0  # the same keys as a step that checked
            spec = {}
        return spec, total, live

    def _step_from(self, spec: dict, stats, t0: float, seen, grad_scale, found_inf,
                   total=None, live: list | None = None) -> None:
        """The step once the overlap's chunks stepped ahead (`spec`) are in. `total`: the
        clip's norm and `live`: the collected gradients, where _take_overlap took them."""
        for tier in self.tiers:  # a state file changed under the job: refused before any change
            tier.check_files()
        scale = None if grad_scale is None else scale_value(grad_scale)
        if live is None:
            live = gradients.collect(self)
        early = self._read_early(live, spec)
        stats["early_read_chunks"] = len(early.get("reads", {}))
        ahead = None  # under a GradScaler: the overlap's gradient fingerprints, taken meanwhile
        try:
            t = time.perf_counter()
            known = []  # per group: gradient fingerprints the finite check took
            if found_inf is not None:  # the scaler has checked every gradient of this rank
                known = seen or []  # taken in the scaler's own pass, if it could
                stats["grads_seen_by_scaler"] = float(seen is not None)
                if spec and not known:  # else fingerprinted beside the norm below
                    ahead = self.overlap.fingerprint_ahead(live, spec, scale)
                finite = float(found_inf.detach().float().sum().item()) == 0.0
                if self._zero:
                    finite = all_ranks_agree(self._params(), finite)
            elif self.config.skip_nonfinite:
                finite, known = gradients.all_finite(self, live, spec)
                finite = self.device_part.finite(finite, self._zero, self._params())
            else:  # stepped as torch steps it, NaN into the weights; the overlap still
                # needs the fingerprints of the gradients its chunks were stepped with
                finite, (_, known, _) = True, scan_grads(self, live, spec)
            stats["grad_check_s"] += time.perf_counter() - t
            if finite:
                for gi, group in enumerate(self.opt.param_groups):
                    if live[gi]:
                        check_group(self.opt, gi, group, self._kinds[gi])
                self.device_part.check()
                if self.config.max_grad_norm is not None:
                    scale, scaled = gradients.clip(self, stats, scale, total)
                    if scaled:  # a non-contiguous gradient was collected as a copy
                        live = gradients.collect(self)
                        known = []  # and every one may have changed
                        if ahead is not None:  # its values are of the gradients before
                            ahead.cancel_(stats)
                            ahead = None
            if ahead is not None:
                known = ahead.result_(stats)
        except BaseException:
            drain(early.get("reads", {}))
            if ahead is not None:
                ahead.cancel_(stats)
            raise
        if not finite:
            drain(early.get("reads", {}))
            reason = "non-finite gradient" if found_inf is None else "GradScaler found inf/NaN"
            self.last_step_stats = {"skipped": True, "reason": reason,
                                    "early_read_chunks": stats["early_read_chunks"],
                                    "total_s": time.perf_counter() - t0,
                                    **self.device_part.stats()}
            if found_inf is None:  # under a GradScaler a skipped step is its normal protocol
                warnings.warn("tierlift offload: a gradient has NaN/Inf values; the step was "
                              "skipped and parameters and optimizer state are unchanged",
                              RuntimeWarning, stacklevel=3)
            return
        self._scale_seen = scale
        scale_t = None if scale is None else torch.tensor([scale], dtype=torch.float32)
        self.device_part.prepare()
        try:
            if self.streamed:
                self._step_streamed(live, spec, stats, early, scale_t, known)
            else:
                for gi, group in enumerate(self.opt.param_groups):
                    if live[gi]:
                        self._step_resident(gi, group, live[gi], stats, scale_t)
        except BaseException:
            self.device_part.forget()
            raise
        t = time.perf_counter()
        with self.clock.span("device_adam"):  # its host part; its kernels run after step()
            started = self._device_time.start()
            self.device_part.launch(scale_t)  # after the offloaded part committed
        stats["device_part_s"] += time.perf_counter() - t
        stats.update(self.device_part.stats())
        if started:  # until its events are done
            stats["device_part_gpu_s"] = None
        stats["total_s"] = time.perf_counter() - t0
        stats["skipped"] = False
        self.last_step_stats = dict(stats)
        # Nothing is queued between the launch and this end event.
        self._device_time.stop(started, legs.device_part_done(self._last_stats))

    def _read_early(self, live: list[dict], spec: dict) -> dict:
        """Starts reading the first chunks of the first group with gradients before the
        gradient check and clipping, so the disk is busy from the start of the step (those
        take ~5% of a step that is otherwise I/O bound). Reads change nothing; a skipped or
        failed step drains them. Only in the plain case: NVMe, no speculative chunks to
        validate first, no parameter whose master must be initialised (that uses slot 0)."""
        if self._engine is None or spec:
            return {}
        gi = next((gi for gi, got in enumerate(live) if got), None)
        if gi is None:
            return {}
        params = self.opt.param_groups[gi]["params"]
        if any("step" not in self.opt.state.get(params[pi], ()) for pi in live[gi]):
            return {}
        tier = self.tiers[gi]
        chunks = [c for c in self._chunks(gi, live[gi], set()) if tier.two_gen(c.ci)]
        reads = {j: tier.read_all(c.ci, self._slots[j], self._what(gi, c))
                 for j, c in enumerate(chunks[:self.n_slots - 1])}
        return {"gi": gi, "chunks": chunks, "reads": reads}

    def _chunks(self, gi: int, grads: dict, kept: set) -> list:
        """The chunks of group gi that this step updates, in order."""
        return [c for c in self.layouts[gi].chunks if c.ci not in kept
                and any(s.pi in grads for s in c.segments)]

    def _params(self) -> list:
        return [p for g in self.opt.param_groups for p in g["params"]]

    def next_steps(self, gi: int, pis) -> dict:
        params = self.opt.param_groups[gi]["params"]
        out = {}
        for pi in pis:
            st = self.opt.state.get(params[pi], {})  # no entry added: torch adds none
            out[pi] = int(st["step"]) + 1 if "step" in st else 1  # a tensor, or a number
        return out

    def _commit_steps(self, gi: int, steps: dict) -> None:
        params = self.opt.param_groups[gi]["params"]
        for pi, s in steps.items():
            self.opt.state[params[pi]]["step"] = torch.tensor(float(s), dtype=torch.float32)

    def _step_resident(self, gi: int, group: dict, grads: dict, stats, scale) -> None:
        steps = self.next_steps(gi, grads)
        chunks = self._chunks(gi, grads, set())
        masters.prepare(self, gi, grads, chunks, stats)
        self._step_views(gi, grads, steps, chunks, stats, scale)
        self._commit_steps(gi, steps)

    def _step_views(self, gi: int, grads: dict, steps: dict, chunks, stats, scale) -> None:
        """Steps host chunks on the tier's own memory, each once any checkpoint save reading
        it has read it; GPU gradients and weights are staged through the slots' grad/copy
        buffers."""
        group, tier = self.opt.param_groups[gi], self.tiers[gi]
        for i, chunk in enumerate(chunks):
            tier._wait_unheld(chunk.ci, tier.gen[chunk.ci])
            bufs = {k: tier.view(k, chunk.ci, self.chunk_elems) for k in tier.kinds}
            # staging, and the master of a device parameter that is its own
            bufs.update({k: v for k, v in self._slots[i % self.n_slots].items()
                         if k in ("grad", "copy") or k not in bufs})
            self._step_chunk(gi, group, group["params"], grads, steps, chunk, bufs, stats,
                             scale=scale)

    def _step_streamed(self, live: list[dict], spec: dict, stats, early: dict, scale,
                       known: list) -> None:
        """Steps every chunk with a gradient that the overlap did not already step validly:
        first the two-generation chunks (into their other copy), waits until those writes are
        durable, then rewrites the one-generation chunks in place (RAM part of a hybrid tier,
        NVMe with nvme_generations=1), and commits (flips the generations and step counts).
        A failure before the in-place part leaves everything as it was."""
        keep: dict[int, list] = {}  # kept chunks, once published
        good_of: dict[int, list] = {}  # [(chunk, Record)] that validate() kept
        for gi, records in spec.items():
            t = time.perf_counter()
            good, bad = validate(self, gi, records, live[gi],
                                 None if scale is None else float(scale),
                                 known[gi] if known else None)
            stats["overlap_check_s"] += time.perf_counter() - t
            good_of[gi] = good  # the bad ones are stepped again below, from the committed state
            stats["overlap_kept_chunks"] += len(good)
            stats["overlap_redone_chunks"] += len(bad)
        done: dict[int, list] = {gi: [] for gi in range(len(self.opt.param_groups))}
        in_place: dict[int, list] = {}
        try:
            for gi in range(len(self.opt.param_groups)):
                grads = live[gi]
                if not grads:
                    continue
                chunks = self._chunks(gi, grads, {c.ci for c, _ in good_of.get(gi, [])})
                steps = self.next_steps(gi, grads)
                rewritten = set()
                masters.prepare(self, gi, grads, chunks, stats, rewritten)
                tier = self.tiers[gi]
                in_place[gi] = [c for c in chunks if not tier.two_gen(c.ci)]
                chunks = [c for c in chunks if tier.two_gen(c.ci)]
                started = early.pop("reads") if early.get("gi") == gi else {}
                if rewritten and started:  # they read masters that have changed since
                    drain(started)
                self.run(gi, grads, steps, chunks, stats, done[gi], started=started,
                         scale=scale)
            self._sync(stats)
            for gi, good in good_of.items():
                keep[gi] = []
                late = publish(self, gi, good, live[gi], stats, keep[gi])
                if late:  # a parameter changed after its chunk's step began: step it again
                    stats["overlap_kept_chunks"] -= len(late)
                    stats["overlap_redone_chunks"] += len(late)
                    masters.prepare(self, gi, live[gi], late, stats)
                    self.run(gi, live[gi], self.next_steps(gi, live[gi]), late, stats, done[gi],
                             scale=scale)
                    self._sync(stats)
        except BaseException as err:
            drain(early.get("reads", {}))
            self._undo(done, keep, live)
            self._raise(err)
        if any(in_place.values()):
            if self._durable is not None:
                try:
                    self._durable.log_grads(live, in_place, stats)
                except BaseException as err:  # nothing was rewritten in place yet
                    self._undo(done, keep, live)
                    self._raise(err)
            self._step_in_place(live, in_place, stats, scale)
        state = self.opt.state
        before = {gi: {pi: state.get(self.opt.param_groups[gi]["params"][pi], {}).get("step")
                       for pi in grads} for gi, grads in enumerate(live)}
        for gi, grads in enumerate(live):
            tier = self.tiers[gi]
            for chunk in done[gi] + keep.get(gi, []):
                tier.flip(chunk.ci)
            if grads:
                self._commit_steps(gi, self.next_steps(gi, grads))
        if self._durable is not None:
            t = time.perf_counter()
            try:
                self._durable.commit()
            except BaseException as err:  # no new manifest (a full drive): the step did not
                if any(in_place.values()):  # happen, unless state was rewritten in place
                    self._broken = (
                        f"a step rewrote optimizer state in place, then could not commit it "
                        f"({type(err).__name__}: {err}); parameters and state are partly at "
                        "the new step. Free space and build the optimizer again on the same "
                        "nvme_path (the reopen finishes the step), or load a checkpoint")
                    raise RuntimeError(self._broken) from err
                for gi in range(len(live)):
                    for chunk in done[gi] + keep.get(gi, []):
                        self.tiers[gi].flip(chunk.ci)  # back to the committed generation
                    params = self.opt.param_groups[gi]["params"]
                    for pi, step in before[gi].items():
                        if step is None:  # its first step: no entry, as before it
                            self.opt.state[params[pi]].pop("step", None)
                            if not self.opt.state[params[pi]]:
                                del self.opt.state[params[pi]]
                        else:
                            self.opt.state[params[pi]]["step"] = step
                self._durable.seq -= 1
                self._undo(done, keep, live)
                self._raise(err)
            stats["manifest_s"] += time.perf_counter() - t

    def _undo(self, done: dict, keep: dict, live: list[dict]) -> None:
        """A step that failed before it committed: the parameters it stepped back to the
        committed masters."""
        for gi in done:
            self._restore(gi, done[gi] + keep.get(gi, []), live[gi])

    def _sync(self, stats) -> None:
        t = time.perf_counter()
        if self._engine is not None:
            with self.clock.span("nvme_write"):
                self._engine.sync()
            self.clock.io.append(("nvme_write", t, time.perf_counter(), 0))
        dt = time.perf_counter() - t
        stats["nvme_write_wait_s"] += dt
        stats["nvme_sync_s"] += dt  # the fdatasync part of the write wait

    def _step_in_place(self, live: list[dict], in_place: dict, stats, scale) -> None:
        """Rewrites the one-generation chunks: host chunks stepped on their own memory, NVMe
        chunks streamed through the pipeline and written back where they were. Nothing can
        undo this part: if it fails, the optimizer refuses to step until a checkpoint is
        loaded."""
        t = time.perf_counter()
        try:
            for gi, chunks in in_place.items():
                tier, grads = self.tiers[gi], live[gi]
                steps = self.next_steps(gi, grads)
                in_ram = [c for c in chunks if tier.viewable(c.ci)]
                self._step_views(gi, grads, steps, in_ram, stats, scale)
                stats["ram_chunks"] += len(in_ram)
                self.run(gi, grads, steps, [c for c in chunks if not tier.viewable(c.ci)],
                         stats, [], scale=scale)
            self._sync(stats)
        except BaseException as err:
            self._broken = (
                f"a step failed while rewriting optimizer state in place ({type(err).__name__}: "
                f"{err}); parameters and state are partly at the new step. Load a checkpoint "
                "(tierlift.checkpoint.load or load_state_dict) before stepping again")
            # A corrupt chunk is found when it is read, right before it is stepped: the chunks
            # before it are rewritten already. Still a ChecksumError, as everywhere else.
            kind = ChecksumError if isinstance(err, ChecksumError) else RuntimeError
            raise kind(self._broken) from err
        stats["in_place_s"] += time.perf_counter() - t

    def _raise(self, err: BaseException):
        if isinstance(err, OSError) and not isinstance(err, ChecksumError):
            where = self._dir or "host memory"
            raise OSError(err.errno, f"offload step failed on the state tier under "
                          f"{where!r}: {err}; parameters and optimizer state are as "
                          "they were before this step") from err
        raise err

    def run(self, gi, grads, steps, chunks, stats, done: list, publish: bool = True,
            started: dict | None = None, scale=None, used_grads: dict | None = None,
            group: dict | None = None, ready: list | None = None,
            staged: dict | None = None, stop=None) -> None:
        """With S pipeline slots: reads chunks k+1 .. k+S-2 ahead while stepping chunk k while
        chunk k-1 is written to the other generation; returns once every write finished.
        Chunks whose parameters were updated are appended to `done` (also when this raises).
        `started`: {j: handles} of the first chunks' reads, already issued into slot j.
        `scale`: the GradScaler scale the gradients still carry (a 1-element fp32 tensor).
        `used_grads`: receives {(ci, pi): fingerprint} of the gradients each chunk read.
        `group`: the hyperparameters to step with (default: the param group's own).
        `ready`: events of the device gradients' production (the overlap's hook recorded them);
        None: the copies wait for what the current stream has queued (d2h.Copier).
        `staged`: the overlap's, staging new device weights (ChunkStep._step_chunk).
        `stop`: read before each chunk of host memory's direct run (the overlap's abandon:
        the rest is left to step()); a pipelined run finishes what it read ahead."""
        params, tier = self.opt.param_groups[gi]["params"], self.tiers[gi]
        group = self.opt.param_groups[gi] if group is None else group
        if chunks and not started and all(tier.direct(c.ci) for c in chunks):
            self._run_direct(gi, group, grads, steps, chunks, stats, done, publish, scale,
                             used_grads, ready, staged, stop)
            return
        n_slots = self.n_slots
        reads: dict[int, list] = dict(started or {})
        writes: dict[int, list] = {}
        used = getattr(tier, "used", None)  # NVMe moves only the used part of a chunk
        journaled = self._durable is not None and self._durable.one_gen
        track = legs.IoTrack(self.clock)  # the engine's busy time
        for handles in reads.values():
            track.add("nvme_read", handles)

        def wait_all(handles, key):
            t = time.perf_counter()
            leg = "nvme_read" if key == "nvme_read_wait_s" else "nvme_write"
            for h in handles:
                with self.clock.span(leg) as span:
                    h.wait()
                    span.until = getattr(h, "done_at", None)  # its CRC after: not the disk's
                stats["checksum_s"] += getattr(h, "crc_s", 0.0)
            stats[key] += time.perf_counter() - t
            track.poll()

        issued = len(reads)  # reads started so far: chunks [0, issued)

        def read_ahead(upto):
            nonlocal issued
            while issued < min(upto, len(chunks)):
                # slot j % S was last used by chunk j-S: its writes and CRC must be done first
                j = issued
                wait_all(writes.pop(j - n_slots, []), "nvme_write_wait_s")
                reads[j] = tier.read_all(chunks[j].ci, self._slots[j % n_slots],
                                         self._what(gi, chunks[j]))
                track.add("nvme_read", reads[j])
                issued += 1

        try:
            for i, chunk in enumerate(chunks):
                read_ahead(i + n_slots - 1)  # chunks i .. i+S-2
                bufs = self._slots[i % n_slots]
                # waits for the reads, then checks their CRC-32C on this thread
                wait_all(reads.pop(i), "nvme_read_wait_s")
                nbytes = chunk_bytes(tier.dtypes, used[chunk.ci] if used else self.chunk_elems,
                                     aligned=used is not None)
                stats["nvme_read_bytes"] += nbytes
                done.append(chunk)
                self._step_chunk(gi, group, params, grads, steps, chunk, bufs, stats, publish,
                                 scale=scale, used_grads=used_grads, ready=ready, staged=staged)
                if journaled and not tier.two_gen(chunk.ci):
                    writes[i] = [self._durable.stage(tier, gi, chunk.ci, i % n_slots, bufs)]
                    stats["journal_write_bytes"] += nbytes
                else:
                    writes[i] = tier.write_all(chunk.ci, bufs, tier.next_gen(chunk.ci))
                    track.add("nvme_write", writes[i])
                for h in writes.get(i - 1, []):  # its journal copy had a chunk's step to land
                    getattr(h, "promote", lambda: None)()
                stats["nvme_write_bytes"] += nbytes
            for i in sorted(writes):
                wait_all(writes.pop(i), "nvme_write_wait_s")
        except BaseException:
            drain(reads)
            drain(writes)
            raise
        finally:
            track.close()

    def _run_direct(self, gi, group, grads, steps, chunks, stats, done: list, publish: bool,
                    scale, used_grads, ready, staged=None, stop=None) -> None:
        """run() for two generations in host memory: the kernel reads each chunk's generation g
        and writes generation g + 1 where they lie, with no slot in between (a slot gives only
        the staging of device gradients and weights). Segments without a gradient are carried
        over to g + 1 as they are, as a whole-chunk copy would have carried them."""
        params, tier = self.opt.param_groups[gi]["params"], self.tiers[gi]
        for i, chunk in enumerate(chunks):
            if stop is not None and stop():
                return
            ci = chunk.ci
            nxt = tier.next_gen(ci)
            tier._wait_unheld(ci, nxt)  # a save may still read the generation this overwrites
            src = {k: tier.peek(k, ci, tier.gen[ci]) for k in tier.kinds}
            bufs = {k: tier.peek(k, ci, nxt) for k in tier.kinds}
            bufs.update({k: v for k, v in self._slots[i % self.n_slots].items()
                         if k not in bufs})
            idle = [s for s in chunk.segments if s.pi not in grads]
            if idle:
                t = time.perf_counter()
                for k in tier.kinds:
                    for s in idle:
                        sl = kind_slice(k, s.clo, s.chi)
                        bufs[k][sl].copy_(src[k][sl])
                stats["carry_s"] += time.perf_counter() - t
            done.append(chunk)
            self._step_chunk(gi, group, params, grads, steps, chunk, bufs, stats, publish,
                             scale=scale, used_grads=used_grads, sources=src, ready=ready,
                             staged=staged)
            stats["direct_chunks"] += 1

    def _restore(self, gi: int, chunks, grads: dict) -> None:
        """Puts the parameters of `chunks` that the failed step updated (`grads`) back to the
        committed master weights. The others it never wrote, and their committed master can be
        older than their value: changed outside the optimizer since their last step, or left by
        a load that had no state for them (they start fresh, as in torch)."""
        params, tier = self.opt.param_groups[gi]["params"], self.tiers[gi]
        if not chunks or "master" not in tier.kinds:
            return
        for chunk in chunks:
            if tier.viewable(chunk.ci):  # host memory: the committed chunk itself
                buf = tier.view("master", chunk.ci, self.chunk_elems)
            else:
                buf = self._slots[0]["master"]
                tier.read("master", chunk.ci, buf).wait()
            for s in chunk.segments:
                if s.pi in grads and s.pi in self._in_file[gi]:
                    params[s.pi].detach().view(-1)[s.plo:s.phi].copy_(buf[s.clo:s.chi])
            self._watch.forget(gi, [(chunk.ci, s.pi) for s in chunk.segments])


__all__ = ["Offloader"]
