"""The highest rate a monotone pass/fail test passes at, by doubling/halving then bisection.

`keeps_up(rate_per_s)` is assumed monotone: true up to some threshold rate, false above it.
The search brackets the threshold between a passing and a failing rate, then halves the bracket
geometrically until the failing rate is within `rel_tol` of the passing one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Bisection:
    """What a search found: `rate_per_s` is the highest passing rate probed (0 if none passed),
    `failed_per_s` the lowest failing one (inf if none failed), `probes` every (rate, passed) in
    order. `pruned`: the first probe, at `must_reach_per_s`, failed, and the search stopped."""

    rate_per_s: float = 0.0
    failed_per_s: float = math.inf
    probes: list[tuple[float, bool]] = field(default_factory=list)
    pruned: bool = False


def bisect_rate(
    keeps_up: Callable[[float], bool],
    start_per_s: float,
    *,
    rel_tol: float = 0.05,
    max_probes: int = 12,
    min_per_s: float = 0.0,
    must_reach_per_s: float | None = None,
) -> Bisection:
    """Search for the threshold of `keeps_up` from `start_per_s`: double while it passes, halve
    while it fails (not below `min_per_s`), then bisect the bracket (geometric midpoints) until
    failed/passed <= 1 + `rel_tol`, or `max_probes` probes were run.

    With `must_reach_per_s`, the first probe is at that rate, and if it fails the search stops
    there (`pruned`): the threshold is below it, which is all a caller that only wants rates above
    it needs to know.
    """
    if not (start_per_s > 0 and rel_tol > 0 and max_probes >= 1):
        raise ValueError(f"bisect_rate: start {start_per_s}, rel_tol {rel_tol}, {max_probes}")
    out = Bisection()

    def probe(rate: float) -> bool:
        ok = keeps_up(rate)
        out.probes.append((rate, ok))
        if ok:
            out.rate_per_s = max(out.rate_per_s, rate)
        else:
            out.failed_per_s = min(out.failed_per_s, rate)
        return ok

    if must_reach_per_s is not None:
        if not probe(must_reach_per_s):
            out.pruned = True
            return out
        start_per_s = 2 * must_reach_per_s
    rate = start_per_s
    while len(out.probes) < max_probes:
        probe(rate)
        if out.rate_per_s == 0:  # nothing passed yet: go down
            rate /= 2
            if rate < min_per_s:
                break
        elif math.isinf(out.failed_per_s):  # nothing failed yet: go up
            rate *= 2
        elif out.failed_per_s / out.rate_per_s <= 1 + rel_tol:
            break
        else:
            rate = math.sqrt(out.rate_per_s * out.failed_per_s)
    return out
