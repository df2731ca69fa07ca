"""Dynamic loss scaling for fp16 (Micikevicius et al. 2018), with DeepSpeed's defaults.

The loss is multiplied by ``scale`` before backward so small gradients stay
representable in fp16; the optimizer divides it out. An overflow (inf/nan in
any gradient on any rank) skips the step and lowers the scale — after
``hysteresis`` overflows in a row — and ``window`` clean steps double it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LossScaler:
    scale: float = 2.0 ** 16
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    factor: float = 2.0
    enabled: bool = True

    def __post_init__(self) -> None:
        self._clean_steps = 0
        self._hysteresis_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        """After a step: an overflow (the step was skipped) lowers the scale, a clean window raises it."""
        if not self.enabled:
            return
        if overflow:
            self._clean_steps = 0
            if self._hysteresis_left <= 1:
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self._hysteresis_left -= 1
            return
        self._clean_steps += 1
        if self._clean_steps % self.window == 0:
            self._hysteresis_left = self.hysteresis
            self.scale *= self.factor

    def state(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left}

    def load(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
