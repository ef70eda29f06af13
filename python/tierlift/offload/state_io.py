"""The state dict side of an Offloader: materialize() builds the in-memory optimizer's state
from the tiers, ingest() moves a loaded state into them all-or-nothing (journal.filling), and
rewriting()/fill_done() track fills that rewrite one-generation chunks in place (also used by
tierlift.checkpoint's streaming load)."""

from __future__ import annotations

import torch

from tierlift.offload import masters, tier_values
from tierlift.offload.journal import filling
from tierlift.offload.layout import SCALE_KIND, kind_elems, kind_slice, not_reserved
from tierlift.offload.tier_values import CODES_KEY
from tierlift.offload.tiers import drain

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _kind_shape(kind: str, p: torch.Tensor) -> tuple:
    """The shape of p's state of one kind as a state dict holds it: p's, or the scales' count."""
    return (kind_elems(kind, p.numel()),) if kind == SCALE_KIND else p.shape


class StateIO:
    """Mixed into Offloader (runner.py), whose tiers, layouts and slots it reads."""

    # Streaming checkpoints of the tiers (never the whole state in RAM) are in
    # tierlift.checkpoint: stream.save_offloaded(offloader, dir), restore.load_offloaded.

    # ---- state dict ----------------------------------------------------------------------
    def materialize(self) -> dict:
        """{param: {kind: CPU tensor}} for every parameter that has taken a step, in the
        in-memory optimizer's state format (fp32, or compact: bf16 m, uint8 v codes, scales)."""
        self.check_readable()
        self.check_lists()
        self.check_state()  # else state_dict() would put the tiers' value over a written one
        out: dict = {}
        for gi, group in enumerate(self.opt.param_groups):
            params, layout, tier = group["params"], self.layouts[gi], self.tiers[gi]
            for pi, p in enumerate(params):  # no segment holds a 0-element one's empty state
                if layout.reserved[pi] and "step" in self.opt.state.get(p, {}):
                    self.check_param(gi, pi, p)  # its state is read by the laid-out numel
                if p.numel() == 0 and "step" in self.opt.state.get(p, {}) \
                        and layout.reserved[pi]:  # not the device part's (device_part.py)
                    out[p] = {k: torch.empty(p.shape if k != SCALE_KIND else (0,),
                                             dtype=tier.dtypes[k])
                              for k in tier.kinds if k != "master" or self._needs_master_key(p)}
            for chunk in layout.chunks:
                segs = [s for s in chunk.segments
                        if "step" in self.opt.state.get(params[s.pi], {})]
                if not segs:
                    continue
                bufs = self._chunk_bufs(gi, chunk)
                for s in segs:
                    p = params[s.pi]
                    kinds = [k for k in tier.kinds if k != "master" or self._needs_master_key(p)]
                    d = out.setdefault(p, {})
                    for k in kinds:
                        t = d.setdefault(k, torch.empty(_kind_shape(k, p), dtype=tier.dtypes[k]))
                        src = bufs[k][kind_slice(k, s.clo, s.chi)]
                        if k == "master" and not self._uses_master(p):
                            src = p.detach().view(-1)[s.plo:s.phi]
                        t.view(-1)[kind_slice(k, s.plo, s.phi)].copy_(src)
        return out

    def read_kind(self, p: torch.Tensor, kind: str) -> torch.Tensor:
        """One kind of p's offloaded state as materialize() gives it (a CPU tensor): what a
        TierValue in optimizer.state[p].items() reads when used (tier_values.py)."""
        self.check_readable()
        self.check_lists()
        gi, pi = self._where(p)
        self.check_param(gi, pi, p)
        tier = self.tiers[gi]
        out = torch.empty(_kind_shape(kind, p), dtype=tier.dtypes[kind])
        for chunk in self.layouts[gi].chunks:
            for s in chunk.segments:
                if s.pi == pi:
                    src = self._chunk_bufs(gi, chunk)[kind][kind_slice(kind, s.clo, s.chi)]
                    out.view(-1)[kind_slice(kind, s.plo, s.phi)].copy_(src)
        return out

    def tier_values(self, p: torch.Tensor) -> dict:
        """{name: TierValue} of p's moments (and a low-precision p's master) held by the tiers,
        by their optimizer.state names; empty for a parameter without offloaded state or one
        that has not stepped."""
        if "step" not in self.opt.state.get(p, ()) or self._broken is not None:
            return {}
        where = self._where(p, missing=None)
        if where is None:
            return {}
        gi, pi = where
        if not self.layouts[gi].reserved[pi]:  # frozen, or the device part's
            return {}
        tier = self.tiers[gi]
        out = {}
        for k in tier.kinds:
            # an fp32 parameter's has no key (state_dict() has none); a low-precision one's is
            # there, as in the in-memory optimizer's state (a flattened DCP load rebuilds the
            # state from these keys, and would re-make the master from the rounded parameter)
            if k == "master" and not self._needs_master_key(p):
                continue
            name = CODES_KEY if k == "exp_avg_sq" and SCALE_KIND in tier.kinds else k
            out[name] = tier_values.make(self, p, k, name, _kind_shape(k, p), tier.dtypes[k])
        return out

    def _where(self, p: torch.Tensor, missing=KeyError):
        """(group, index) of parameter p in the params lists as built (check_lists keeps them)."""
        index = self.__dict__.get("_index")
        if index is None:
            index = self._index = {id(q): (gi, pi) for gi, g in enumerate(self._built)
                                   for pi, q in enumerate(g)}
        where = index.get(id(p))
        if where is not None and self._built[where[0]][where[1]] is p:
            return where
        if missing is None:
            return None
        raise KeyError("not a parameter of this optimizer")

    def check_readable(self) -> None:
        """Refuses to read the state out (state_dict(), a checkpoint save) while step() refuses
        to step: an in-place rewrite that failed half way left it part one state, part another,
        which a reader would take as one (a checkpoint of it loads without a word)."""
        if self._broken is not None:
            raise RuntimeError(f"the optimizer state cannot be read out: {self._broken}; until "
                               "then it is partly one state and partly another")

    def masters_from_param(self, p: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
        """The master of ranges of p.view(-1) that a caller put back after a step set from p
        (masters.from_param): what state_dict(), checkpoints and the next step read."""
        masters.from_param(self, p, ranges)

    def _needs_master_key(self, p) -> bool:
        return p.dtype in _LOW_PRECISION

    def _chunk_bufs(self, gi, chunk) -> dict:
        tier = self.tiers[gi]
        self.quiet()
        if tier.viewable(chunk.ci):
            return {k: tier.view(k, chunk.ci, self.chunk_elems) for k in tier.kinds}
        bufs = self._slots[0]
        for k in tier.kinds:
            tier.read(k, chunk.ci, bufs[k]).wait()
            tier.verify(k, chunk.ci, bufs[k], self._what(gi, chunk))
        return bufs

    def quiet(self, replacing: bool = False) -> None:
        """Waits for the overlap's worker, which uses the pipeline slots (a state_dict() or a
        load between backward and step()); `replacing`: the committed state is about to be
        replaced, so its chunks stepped ahead are stepped again at step()."""
        if self.overlap is not None:
            if replacing:
                self.overlap.discard()
            else:
                self.overlap.wait()

    def ingest(self, loaded: dict, before_commit=None) -> None:
        """Moves {param: {kind: tensor}} (from a state dict) into the tiers, all-or-nothing.
        The tensors are in this optimizer's state format (Adam converts a state dict first).
        Shapes are checked first; NVMe chunks go to the other generation and flip together at
        the end, host chunks are filled in place behind an undo journal (journal.Journal), so a
        failure (a full drive, an interrupt) leaves the tiers as they were. `before_commit`, if
        given, is called last, before the flips; if it raises, everything is undone."""
        self.check_lists()
        for gi, group in enumerate(self.opt.param_groups):
            for pi, p in enumerate(group["params"]):
                if p in loaded and not self.layouts[gi].reserved[pi]:
                    raise ValueError(not_reserved(self._name(gi, pi), self.config.offload,
                                                  "has state in the state dict being loaded"))
                if p in loaded:
                    self.check_param(gi, pi, p)
                for k, v in loaded.get(p, {}).items():
                    want = kind_elems(k, p.numel())
                    if isinstance(v, torch.Tensor) and k in self.tiers[gi].kinds and \
                            v.numel() != want:
                        raise ValueError(f"the state {k!r} of {self._name(gi, pi)} has "
                                         f"{v.numel()} elements, {want} expected (the "
                                         f"parameter has {p.numel()})")
        self.quiet(replacing=True)
        # a strided parameter's master is read from it in logical order (strided.py)
        with self.contiguous_data(write_back=False), \
                filling(self._engine, before_commit) as (journal, flips):
            for gi, group in enumerate(self.opt.param_groups):
                params, layout = group["params"], self.layouts[gi]
                for chunk in layout.chunks:
                    segs = [s for s in chunk.segments if params[s.pi] in loaded]
                    if segs:
                        self._ingest_chunk(gi, chunk, segs, loaded, journal, flips)
        for gi, group in enumerate(self.opt.param_groups):
            # One without loaded state starts fresh, as in torch: the master the tiers still
            # hold is no longer its own (a durable reopen would put it into the parameter).
            for pi, p in enumerate(group["params"]):
                if p in loaded:
                    self._in_file[gi].add(pi)
                else:
                    self._in_file[gi].discard(pi)
        self.fill_done()

    def _ingest_chunk(self, gi, chunk, segs, loaded, journal, flips) -> None:
        params, tier = self.opt.param_groups[gi]["params"], self.tiers[gi]
        view = tier.viewable(chunk.ci)
        bufs = self._chunk_bufs(gi, chunk)
        for s in segs:
            p = params[s.pi]
            vals = loaded[p]
            for k in tier.kinds:
                dst = bufs[k][kind_slice(k, s.clo, s.chi)]
                if view:  # a view of the tier itself: its bytes go to the journal first
                    journal.keep(dst)
                if k in vals:
                    dst.copy_(vals[k].detach().reshape(-1)[kind_slice(k, s.plo, s.phi)])
                elif k == "master":
                    dst.copy_(p.detach().view(-1)[s.plo:s.phi])
                else:
                    dst.zero_()
        if not view:
            self.rewriting(tier, chunk.ci)
            handles = tier.write_all(chunk.ci, bufs, tier.next_gen(chunk.ci))
            for i, h in enumerate(handles):
                try:
                    h.wait()
                except BaseException:  # nothing may stay in flight from the slot
                    drain({0: handles[i + 1:]})
                    raise
            if tier.two_gen(chunk.ci):
                flips.append((tier, chunk.ci))

    def rewriting(self, tier, ci: int) -> None:
        """A fill is about to rewrite chunk ci on disk: in place when the tier keeps one
        generation, which no journal undoes, so a fill that fails from here on leaves the
        optimizer refusing to step until a fill succeeds."""
        if not tier.two_gen(ci) and self._broken is None:
            self._broken = ("a checkpoint load failed after it had rewritten optimizer state "
                            "kept in one generation (nvme_generations=1); load a checkpoint "
                            "before stepping again")
            if self._durable is not None:  # a reopen says the same
                self._durable.write_manifest(filling=True)

    def fill_done(self) -> None:
        """A fill of every chunk committed (and the step counts set): whatever refused steps
        before is replaced. The parameters are compared with their new masters at the next
        step (either may have been loaded first)."""
        self._broken = None
        self._watch.forget()
        if self._durable is not None:
            self._durable.commit()
