"""The dry-run plan's costly pure parts, remembered across the plans of one layout search.

A search (megazero.plan.search) costs thousands of layouts; each plan builds a
schedule (millions of actions at thousands of microbatches), walks it for the
activation peak, balances the layers and counts a meta-built model's
parameters, though most layouts share those inputs. ``make_plan`` and
``megazero.config.resolve.resolve`` (its layer balancing) take a :class:`PlanMemo`
as an explicit input: without one (a run, a dry run) they call the functions directly.

What is kept: the latest schedule only (it can hold millions of actions; the
search brings the layouts that share one together) and the peaks along it;
small results (a layer's activation bytes, a layer split, parameter counts)
for the search's life. One search's object; never shared between threads.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from megazero.parallel.schedules import Action, build_schedule


class PlanMemo:
    """Pass-through when ``remember`` is False (what a run uses), remembering when True (a search)."""

    def __init__(self, remember: bool = True):
        self.remember = remember
        self._schedule_key: Any = None
        self._schedule: list[Action] = []
        self._peaks: dict = {}
        self._small: dict = {}

    def schedule(self, name: str, pp: int, m: int, v: int = 1) -> list[list[Action]]:
        if not self.remember:
            return build_schedule(name, pp, m, v)
        key = (name, pp, m, v)
        if key != self._schedule_key:
            self._schedule_key, self._peaks = None, {}
            self._schedule, self._schedule_key = build_schedule(name, pp, m, v), key
        return list(self._schedule)

    def peak(self, fn: Callable, actions: list[Action], per_microbatch: list[int]) -> tuple[int, int]:
        """``fn(actions, per_microbatch)`` (the activation peak) along the kept schedule."""
        if not self.remember:
            return fn(actions, per_microbatch)
        key = (id(actions), tuple(per_microbatch))  # the kept schedule's rank lists: checked by identity below
        if key not in self._peaks or self._peaks[key][0] is not actions:
            self._peaks[key] = (actions, fn(actions, per_microbatch))
        return self._peaks[key][1]

    def call(self, fn: Callable, *args: Any, key: Optional[tuple] = None, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, remembered under ``key`` (default: the arguments)."""
        if not self.remember:
            return fn(*args, **kwargs)
        k = (fn.__module__, fn.__qualname__, args if key is None else key, tuple(sorted(kwargs.items())))
        if k not in self._small:
            self._small[k] = fn(*args, **kwargs)
        out = self._small[k]
        return list(out) if isinstance(out, list) else out  # a caller may keep (and change) a list
