"""One chunk's Adam step on the host: the segments of a chunk that have a gradient, stepped by
the fused SIMD kernel in place or out of place (generation g read, g + 1 written), with device
gradients and weights staged through the chunk's slot and the new weights published."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from tierlift import ops
from tierlift.offload import d2h
from tierlift.offload.layout import SCALE_KIND, kind_slice
from tierlift.offload.watch import fingerprints


class ChunkStep:
    """Mixed into Offloader (runner.py), whose optimizer, state dtype, slots, clock, copier,
    uploader and parameter watch it uses."""

    @staticmethod
    def _staging(p: torch.Tensor, s, bufs: dict, kind: str = "copy") -> torch.Tensor:
        """Host staging of segment `s` of device tensor `p` (a parameter, or with kind="grad"
        its gradient), in p's dtype (a slot's buffers are fp32-sized, so any dtype fits)."""
        n = p.element_size()
        return bufs[kind].view(torch.uint8)[s.clo * n:s.chi * n].view(p.dtype)

    def _step_chunk(self, gi, group, params, grads, steps, chunk, bufs, stats,
                    publish: bool = True, scale=None, used_grads: dict | None = None,
                    sources: dict | None = None, ready: list | None = None,
                    staged: dict | None = None) -> None:
        """Steps the segments of `chunk` with a gradient: state in `bufs` (a slot, or the
        tier's own memory), read from `sources` instead where given ({kind: chunk tensor}: out
        of place, the kernel reads generation g there and writes g + 1 into `bufs`). Device
        gradients (and device weights that are their own master) are copied into the slot
        after `ready` (d2h.Copier), and only those copies are waited for. New device weights
        are rounded into the slot's copy buffer and uploaded without a wait (h2d.Uploader).
        `staged` (a speculative step, publish=False): where the device staging covers the
        chunk, its new device weights are rounded into the copy buffer all the same and
        uploaded into the shadow on the side stream (device_staging.py); `staged` receives
        {(ci, pi): fingerprint} of the bytes uploaded."""
        t = time.perf_counter()
        shadow = self._device_staging
        stage = (not publish and staged is not None and shadow is not None
                 and shadow.covers(gi, chunk, grads, params))
        to_shadow = []  # (shadow segment, host staging)
        d2h_pairs = []  # (host staging, device tensor)
        buckets: dict = defaultdict(lambda: defaultdict(list))
        h2d = []
        used = []  # (key, gradient as read)
        written = []  # (key, parameter bytes as written), for ParamWatch
        amsgrad = group["amsgrad"]
        for s in chunk.segments:
            if s.pi not in grads:
                continue
            p = params[s.pi]
            # a strided parameter is contiguous in step() (strided.py); the overlap's worker
            # neither publishes nor reads it here (its master is in the tiers)
            pflat = p.detach().view(-1)[s.plo:s.phi] if p.is_contiguous() else None
            # .get: a read on the overlap's worker must not add entries to the defaultdict
            fresh = "step" not in self.opt.state.get(p, ())
            if fresh:
                for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", SCALE_KIND):
                    if k in bufs:
                        bufs[k][kind_slice(k, s.clo, s.chi)].zero_()
            b = buckets[steps[s.pi]]
            g = grads[s.pi][s.plo:s.phi]
            if d2h.on_device(g):
                # In its own dtype: the bytes validate() fingerprints on the device are these
                # (an fp32 copy of a bf16 gradient never matched, so no chunk was kept), and a
                # bf16 gradient moves half the bytes.
                host_grad = self._staging(g, s, bufs, "grad")
                d2h_pairs.append((host_grad, g))
                g = host_grad
            used.append(((chunk.ci, s.pi), g))
            stored = self._uses_master(p)
            if stored or d2h.on_device(p):
                master = bufs["master"][s.clo:s.chi]
                if not stored:  # fp32 device weights are their own master: step a copy
                    d2h_pairs.append((master, pflat))
                b["params"].append(master)
                if sources is not None:
                    b["master_from"].append(sources["master"][s.clo:s.chi] if stored
                                            else master)
                if publish and not d2h.on_device(p):
                    b["copies"].append(pflat)
                elif publish:
                    staging = self._staging(p, s, bufs)
                    b["copies"].append(staging)
                    h2d.append((pflat, staging))
                elif stage:  # covers(): every segment here is staged, so no bucket is mixed
                    staging = self._staging(p, s, bufs)
                    b["copies"].append(staging)
                    to_shadow.append((shadow.segment(gi, chunk.ci, s, p), staging))
                if (publish and stored) or stage:
                    written.append(((chunk.ci, s.pi), b["copies"][-1]))
            else:
                b["params"].append(pflat)
                b["copies"].append(pflat)
                if sources is not None:  # its own master: stepped in place
                    b["master_from"].append(pflat)
            b["grads"].append(g)
            moments = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())
            if self.state_dtype == "bf16":
                moments += (SCALE_KIND,)
            for k in moments:
                sl = kind_slice(k, s.clo, s.chi)
                b[k].append(bufs[k][sl])
                if sources is not None:  # a first step starts from the zeros written above
                    b[f"{k}_from"].append(bufs[k][sl] if fresh else sources[k][sl])
        if d2h_pairs:
            with self.clock.span("d2h"):
                self._wait_copies(d2h_pairs, ready)
            stats["d2h_s"] += time.perf_counter() - t
        if used_grads is not None:  # the overlap keeps the step only if these stay the same
            t = time.perf_counter()
            used_grads.update(zip([k for k, _ in used], fingerprints([g for _, g in used])))
            stats["grad_fingerprint_s"] += time.perf_counter() - t
        if h2d or to_shadow:  # the kernel rewrites the staging: its last upload must be done
            self._h2d(stats, self._uploads.reserve, bufs["copy"])
        t1 = time.perf_counter()
        amp = {} if scale is None else {"grad_scale": scale}
        with self.clock.span("adam"):
            self._adam(group, buckets, amp, amsgrad)
        stats["cpu_step_s"] += time.perf_counter() - t1
        if h2d:  # in flight while the next chunk is stepped (h2d.Uploader)
            self._h2d(stats, self._uploads.upload, h2d, bufs["copy"])
        if to_shadow:  # during backward, on the side stream; published in step()
            self._h2d(stats, shadow.upload, gi, to_shadow, bufs["copy"], self._uploads)
        if written:  # of the host staging, which the upload only reads
            t = time.perf_counter()
            seen = dict(zip([k for k, _ in written], fingerprints([w for _, w in written])))
            if stage:  # its parameters are written only if step() keeps it (overlap.publish)
                staged.update(seen)
            else:
                self._watch.record(gi, seen)
            stats["param_check_s"] += time.perf_counter() - t

    def _h2d(self, stats, call, *args) -> None:
        """`call(*args)` counted as H2D time (issuing uploads, or waiting for one)."""
        t = time.perf_counter()
        with self.clock.span("h2d"):
            call(*args)
        stats["h2d_s"] += time.perf_counter() - t

    def _wait_copies(self, pairs: list, ready: list | None) -> None:
        """Copies a chunk's device tensors into its host staging and waits for those copies
        alone: on the copy stream, after `ready` (d2h.Copier), not for every kernel queued."""
        for event in self._copier.copy(pairs, ready):
            event.synchronize()

    def _adam(self, group: dict, buckets: dict, amp: dict, amsgrad: bool) -> None:
        """The fused SIMD Adam over a chunk's segments, one call per step count."""
        beta1, beta2 = group["betas"]
        for step, b in buckets.items():
            # Out of place (_run_direct): where the old state is read.
            src = {f"{name}_from": b.get(f"{k}_from") for name, k in (
                ("params", "master"), ("exp_avgs", "exp_avg"), ("exp_avg_sqs", "exp_avg_sq"),
                ("max_exp_avg_sqs" if self.state_dtype != "bf16" else "exp_avg_sq_scales",
                 "max_exp_avg_sq" if self.state_dtype != "bf16" else SCALE_KIND))}
            if self.state_dtype == "bf16":
                ops.adam_compact_step_(
                    b["params"], b["grads"], b["exp_avg"], b["exp_avg_sq"], b[SCALE_KIND],
                    b["copies"], lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=group["weight_decay"], step=step,
                    decoupled=self.opt._decoupled(group), maximize=group["maximize"], **amp,
                    **src)
                continue
            ops.adam_step_(
                b["params"], b["grads"], b["exp_avg"], b["exp_avg_sq"], b["max_exp_avg_sq"],
                b["copies"], lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=group["weight_decay"], step=step,
                decoupled=self.opt._decoupled(group), amsgrad=amsgrad,
                maximize=group["maximize"], **amp, **src)


__all__ = ["ChunkStep"]
