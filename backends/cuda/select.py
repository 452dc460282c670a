"""Which mechanism moves a job fastest, as `auto` first rates them: a small cost model
(`CostModel`, an H200's figures by default), the prior that `tuning` measures against.

A job costs the larger of its device time and the host time it takes to enqueue, counted as an
engine submits: job after job while the GPU works on the earlier ones. The device time of a
launch that holds SMs for the whole transfer (``expand_direct``) is weighed by
`CostModel.sm_weight`: a kernel of the model that needs such an SM waits for it, so a long
launch slows the model's kernels beside it, a brief one next to nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# A launch that holds SMs this long counts its whole `CostModel.sm_penalty`: about the length
# of a model's kernels.
SM_HOLD_S = 100e-6


@dataclass
class CostModel:
    """Seconds a job takes, per mechanism. Defaults: an NVIDIA H200's, PCIe Gen5."""

    ce_desc_s: dict = field(default_factory=lambda: {"store": 223e-9, "load": 262e-9})  # 256 B copies: 1.1 / 1.0 GB/s
    ce_gbps: dict = field(default_factory=lambda: {"store": 55.3, "load": 55.5})
    ce_tail_s: float = 1.4e-9  # what a 16 KiB copy costs beyond its bytes at link speed
    ce_host_s: float = 0.44e-6  # host time per copy inside the batch call (16 KiB copies)
    # host-to-device copies this small cost the batch call host time by their bytes too: the
    # driver moves them through the CPU
    inline_h2d_bytes: int = 16384
    inline_h2d_gbps: float = 6.0
    sm_gbps: dict = field(default_factory=lambda: {"store": 52.6, "load": 51.3})
    sm_desc_s: dict = field(default_factory=lambda: {"store": 5.3e-9, "load": 5.5e-9})  # a 256 B copy, whole: job / n
    gather_gbps: float = 1350.0  # device-side gather of scattered 16 KiB pages into staging
    gather_desc_s: float = 2.6e-9
    sm_penalty: float = 2.0  # what a second of a long launch that holds SMs counts in the choice (`sm_weight`)
    launch_s: float = 8e-6  # a batch call
    loop_s_per_desc: float = 3e-6  # one ctypes call and one cuMemcpyAsync (drivers without the batch call)

    def estimate(
        self, mechanism: str, direction: str, items: int, nbytes: int, segments: int = 0, small_bytes: int = 0
    ) -> float:
        """Predicted seconds for a job of `items` copies (expanded, unmerged) and `nbytes` by
        `mechanism` (``ce_batch``, ``ce_loop``, ``expand_staged`` or ``expand_direct``), its host bytes in
        `segments` contiguous ranges (on loads, `small_bytes` of them in segments of up to
        `inline_h2d_bytes`).

        Raises:
            ValueError: an unknown mechanism.
        """
        if mechanism == "ce_batch":
            items = max(1, items)
            # per copy, a fixed cost or the link's speed plus a tail, whichever is slower
            device = items * self._ce_per_copy(direction, nbytes / items) + self.launch_s
            small = direction == "load" and nbytes / items <= self.inline_h2d_bytes
            inline = nbytes / (self.inline_h2d_gbps * 1e9) if small else 0.0
            return device + items * self.ce_host_s + inline  # not max: the call overlaps its own copies poorly
        if mechanism == "ce_loop":
            return max(1, items) * self.loop_s_per_desc + nbytes / (self.ce_gbps[direction] * 1e9)
        if mechanism == "expand_staged":
            segments = max(1, segments)
            link = segments * self._ce_per_copy(direction, nbytes / segments)
            gather = nbytes / (self.gather_gbps * 1e9) + items * self.gather_desc_s
            inline = small_bytes / (self.inline_h2d_gbps * 1e9) if direction == "load" else 0.0
            # the gather and the link's copies pipelined through two staging halves
            return max(link, gather) + min(link, gather) / 6 + segments * self.ce_host_s + inline
        if mechanism == "expand_direct":
            bw = self.sm_gbps[direction] * 1e9
            per_copy = max(0.0, self.sm_desc_s[direction] - 256 / bw)  # a 256-byte copy beyond its bytes
            seconds = nbytes / bw + items * per_copy
            return seconds * self.sm_weight(seconds)
        raise ValueError(f"unknown mechanism {mechanism!r}")

    def sm_weight(self, seconds: float) -> float:
        """What each second of a launch that holds SMs for `seconds` counts in the choice: 1
        for a brief launch, rising to `sm_penalty` for one of `SM_HOLD_S` and longer."""
        return 1.0 + (self.sm_penalty - 1.0) * min(1.0, seconds / SM_HOLD_S)

    def _ce_per_copy(self, direction: str, size: float) -> float:
        return max(self.ce_desc_s[direction], size / (self.ce_gbps[direction] * 1e9) + self.ce_tail_s)


def cheapest(estimates: dict[str, float]) -> str:
    """The cheapest of `estimates` (seconds by name), where one later in their order must be 2%
    cheaper to win: near ties go to the earlier (the copy engines', which leave the SMs alone)."""
    best, low = "", math.inf
    for name, t in estimates.items():
        if not best or t < 0.98 * low:  # 2% below every earlier one
            best = name
        low = min(low, t)
    return best
