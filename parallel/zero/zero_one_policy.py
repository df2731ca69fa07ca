"""0/1 Adam's two policies (Lu et al. 2022, section 4; the schedules of the authors' DeepSpeed implementation) as
closed forms of the step, so that a resume needs no counters: T_v, the steps that update the variance, and T_u,
the synchronisations past the freeze."""
from __future__ import annotations


def variance_interval(t: int, freeze: int, kappa: int) -> int:
    """T_v's interval at step t (0 past the freeze): 2^j for the j-th group of ``kappa`` updates, each group taking
    the next ``kappa`` multiples of its interval (DeepSpeed's counter, in O(log t))."""
    if t > freeze:
        return 0
    interval, end = 1, kappa
    while t > end:
        interval *= 2
        end = (end // interval + kappa) * interval
    return interval


def variance_updates(t: int, freeze: int, kappa: int) -> int:
    """How many of steps 1..t are in T_v (the variance's bias correction: 1 - beta2 ** this)."""
    t, count, interval, before, end = min(t, freeze), 0, 1, 0, kappa
    while t > end:
        count += end // interval - before // interval
        before, interval = end, interval * 2
        end = (end // interval + kappa) * interval
    return count + t // interval - before // interval


def updates_variance(t: int, freeze: int, kappa: int) -> bool:
    """Step t is in T_v: up to the freeze, a multiple of its interval."""
    interval = variance_interval(t, freeze, kappa)
    return interval > 0 and t % interval == 0


def local_interval(t: int, freeze: int, scaler: int, clipper: int) -> int:
    """T_u's interval at step t: 1 up to the freeze, then doubled every ``scaler`` steps, at most ``clipper``."""
    if t <= freeze:
        return 1
    return min(clipper, 2 ** min((t - freeze - 1) // scaler, 62))


def silent_steps(t: int, freeze: int, scaler: int, clipper: int, last_step: int = 0) -> int:
    """How many of steps 1..t sent nothing (local steps): a block of ``scaler`` steps at a time."""
    silent, a, j = 0, freeze + 1, 0
    while a <= t:
        k = min(clipper, 2 ** min(j, 62))
        b = t if k == clipper else min(t, a + scaler - 1)  # at H the interval stays: the rest at once
        silent += (b - a + 1) - (b // k - (a - 1) // k)
        if a <= last_step <= b and last_step % k:
            silent -= 1
        a, j = b + 1, j + 1
    return silent
