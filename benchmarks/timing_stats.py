"""The timing suites' statistics: paired ratios with a confidence interval, and the A/A check.

A timing suite runs its contenders interleaved in rounds (``common.interleave``: the order changes every
round, so no contender always runs first) and compares two contenders by the ratio of their per-round median
step times. A ratio is only worth a verdict when the machine lets two *identical* jobs come out the same, so
every timing suite carries an A/A pair -- two contenders with the same configuration -- whose ratio must come
out with an interval that holds 1.00. A case whose A/A interval excludes 1.00 says so, and its other ratios
get no verdict (``met`` is None, ``verdict`` says why): the ratio is still reported, with its interval. A
ratio whose interval spans its target gets no verdict either: the rounds cannot tell met from missed.

The interval: a two-sided 95 % Student-t interval of the geometric mean of the per-round ratios (a t
interval on their logarithms), so that ``a/b`` and ``b/a`` get reciprocal intervals.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

#: two-sided 95 % quantiles of Student's t by degrees of freedom; between rows the smaller df's (wider) value
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}


def t975(df: int) -> float:
    """Student's t two-sided 95 % quantile for ``df`` degrees of freedom (conservative between table rows)."""
    if df < 1:
        raise ValueError(f"df={df}: a t interval needs at least 2 rounds")
    rows = [d for d in T975 if d <= df]
    return T975[max(rows)] if df <= 120 else 1.960


def median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(vals) if vals else None


def _present(x: float | None) -> bool:
    return x is not None and not math.isnan(x)


def ratio_interval(per_round: Sequence[float]) -> tuple[float, float, float] | None:
    """(geometric mean, low, high) of the per-round ratios, the 95 % t interval on their logs; None below 2
    rounds (no spread to estimate)."""
    logs = [math.log(r) for r in per_round if r > 0]
    if len(logs) < 2:
        return None
    mean, sd = statistics.fmean(logs), statistics.stdev(logs)
    half = t975(len(logs) - 1) * sd / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def paired_ratio(num: Sequence[float | None], den: Sequence[float | None]) -> dict[str, Any]:
    """Ratio num/den of per-round medians, over the rounds both sides completed (``None``: failed).

    ``value`` is the median of the per-round ratios; ``ratio_of_medians`` uses the same rounds only
    (a median over rounds one side lacks would compare different moments of a shared machine);
    ``rounds_paired`` / ``rounds_unpaired`` say how many rounds each figure stands on; ``geo_mean`` and
    ``ci95`` ([low, high]) are :func:`ratio_interval`'s (None below 2 rounds).
    """
    pairs = [(a, b) for a, b in zip(num, den) if _present(a) and _present(b) and b]
    per_round = [a / b for a, b in pairs]
    mn, md = median(a for a, _ in pairs), median(b for _, b in pairs)
    interval = ratio_interval(per_round)
    return {
        "value": median(per_round),
        "per_round": per_round,
        "ratio_of_medians": (mn / md) if mn is not None and md else None,
        "rounds_paired": len(pairs),
        "rounds_unpaired": max(len(num), len(den)) - len(pairs),
        "geo_mean": interval[0] if interval else None,
        "ci95": [interval[1], interval[2]] if interval else None,
    }


def judge(ratio: dict[str, Any], target: float | None, aa: bool) -> dict[str, Any]:
    """Set ``ratio``'s ``target``, ``aa`` and ``met``. An A/A pair: whether its interval holds 1.00 (None
    below 2 rounds). Else, against the target: met when the whole interval is within it, missed when the whole
    interval is above it, and no verdict (``met`` None, ``verdict`` says so) when the interval spans it --
    the rounds cannot tell; with one round (no interval) the median ratio decides."""
    ratio["target"], ratio["aa"] = (1.0 if aa else target), aa
    ci = ratio.get("ci95")
    if aa:
        ratio["met"] = None if ci is None else ci[0] <= 1.0 <= ci[1]
    elif target is None or ratio["value"] is None:
        ratio["met"] = None
    elif ci is None:
        ratio["met"] = ratio["value"] <= target
    elif ci[1] <= target or ci[0] > target:
        ratio["met"] = ci[1] <= target
    else:
        ratio["met"] = None
        ratio["verdict"] = (f"undecided: the interval [{ci[0]:.3f}, {ci[1]:.3f}] spans the target {target:g} "
                            "(more rounds or a quieter machine narrow it)")
    return ratio


def withhold_if_aa_failed(ratios: dict[str, dict[str, Any]]) -> str | None:
    """When an A/A ratio of one case came out with an interval that excludes 1.00 (or has no interval): the
    other ratios of the case lose their verdict (``met`` None, ``verdict`` why). Returns that reason."""
    failed = [(name, r) for name, r in ratios.items() if r.get("aa") and not r.get("met")]
    if not failed:
        return None
    name, r = failed[0]
    ci = r.get("ci95")
    shown = (
        f"{r['value']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"
        if ci and r.get("value")
        else "no interval (< 2 rounds)"
    )
    reason = (
        f"withheld: the A/A pair {name} came out at {shown}, not an interval holding 1.00 -- the machine "
        "was too noisy (or the rounds too few) for a verdict; rerun with more --reps on a quiet machine"
    )
    for other in ratios.values():
        if not other.get("aa") and other.get("target") is not None:
            other["met"] = None
            other["verdict"] = reason
    return reason
