"""0/1 Adam's two policies (Lu et al. 2022, section 4) as closed forms of the step or of its learning rate, so
that a resume needs no counters: T_v, the steps that update the variance (the authors' DeepSpeed schedule), and
T_u, the synchronisations past the freeze (that schedule, or the learning-rate-based rule)."""
from __future__ import annotations

from dataclasses import dataclass


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


def lr_interval(lr: float, peak_lr: float, clipper: int) -> int:
    """T_u's interval by the learning rate: the largest power of two <= peak_lr / lr, at most ``clipper``. An
    interval's local steps then move the weights by at most what one step at the peak rate does (lr * H <=
    peak_lr): the ranks may drift apart for longer as the rate decays. A constant rate never skips a step."""
    if peak_lr <= 0.0:
        return 1
    if lr <= 0.0:
        return clipper
    ratio = int(peak_lr / lr)
    return min(clipper, 1 << (ratio.bit_length() - 1)) if ratio >= 1 else 1


@dataclass(frozen=True)
class LocalSteps:
    """T_u past the freeze: the step schedule (``local_interval``) or, ``by_lr``, the learning rate's
    (``lr_interval`` against ``peak_lr``). A step synchronises when it is a multiple of its interval."""

    freeze: int
    scaler: int
    clipper: int
    by_lr: bool = False
    peak_lr: float = 0.0

    def interval(self, t: int, lr: float) -> int:
        if t <= self.freeze:
            return 1
        if self.by_lr:
            return lr_interval(lr, self.peak_lr, self.clipper)
        return local_interval(t, self.freeze, self.scaler, self.clipper)


def silent_steps(t: int, steps: LocalSteps) -> int:
    """Steps freeze + 1 .. t that sent nothing under the step rule (a run's last step, which always sends, aside)."""
    assert not steps.by_lr, "the learning-rate rule has no closed form over steps"
    return sum(1 for s in range(steps.freeze + 1, t + 1) if s % steps.interval(s, 0.0) != 0)
