"""GradScaler's `grad_scale` and `found_inf` attributes on tierlift's Adam (torch's AMP protocol
for fused optimizers: GradScaler.step sets both, calls optimizer.step(), then deletes both).

A step that raises leaves them set, and GradScaler's next step() multiplies its scale into the
one left behind. The eager step deletes them when it raises; a compiled one
(torch.compile(optimizer.step)) cannot: its Python `except` runs only where tracing raised,
not where an op in the graph refuses (a bad scale, a bad tensor lr). So they are set through
these properties, and a scale set while the found_inf of a step that never returned is still
there is refused, after both are cleared: the next scaler.step() then sets the right scale.
A step that returns records its found_inf in `_last_found_inf` (also what
amp_skipped_last_step reads); a compiled step does so only when its graph ran through."""

from __future__ import annotations


def _stale(opt) -> bool:
    d = opt.__dict__
    return "found_inf" in d and d.get("_last_found_inf") is not d["found_inf"]


def _attribute(name: str, doc: str) -> property:
    def get(self):
        try:
            return self.__dict__[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}") \
                from None

    def set_(self, value):
        if _stale(self):
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise RuntimeError(
                f"optimizer.{name} is being set while the grad_scale and found_inf set for an "
                "earlier step are still there and no step() returned with them: the step "
                "raised inside torch.compile(optimizer.step), which cannot clear them, and "
                "GradScaler would multiply its scale into the stale one. Both are cleared now "
                "and nothing changed; call scaler.step(optimizer) again")
        self.__dict__[name] = value

    def delete(self):
        try:
            del self.__dict__[name]
        except KeyError:
            raise AttributeError(name) from None

    return property(get, set_, delete, doc)


grad_scale = _attribute("grad_scale", "GradScaler's scale for this step (set by GradScaler).")
found_inf = _attribute("found_inf", "GradScaler's inf/NaN verdict for this step.")
