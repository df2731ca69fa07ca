"""The optimizers ZeRO can run, one row each: ``optim.name`` picks a row, ``optim.<name>.*`` is its section.

A new optimizer is a file in ``parallel/zero/`` with a class that fulfils ``parallel.zero.update.Update`` and a
factory, plus one row here. Everything that lists optimizers reads this table: the config's sections and their
ranges, the valid names of ``optim.name`` and the refusal of the flat keys that moved (``megazero.config``), the
rules (where its states may live, which ZeRO stages it runs at, which of its keys name a step of the run), the
engine's build, the planner's extra step work, what a checkpoint keeps per rank and what a resume demands.
Nothing outside this file compares ``optim.name`` to a name.

This file imports neither torch nor an optimizer's file: loading a config stays torch-free
(``tests/config/test_resolve.py``), so each section is declared beside its row and the factories import their
file when first called. A section declares its keys with a comment each, the keys' bounds (``RANGES``: (min,
max); ``PROBABILITY``: in [0, 1); ``CHOICES``: the valid values), as ``megazero.config.ranges`` reads them.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from megazero.plan.optimizer_step import OptimizerStep
    from megazero.parallel.zero.update import Update, UpdateContext

_EPS = (1e-30, 1.0)  # 0 makes 0/0 of a gradient that has been 0 so far; past 1 it is plain momentum SGD
_STEPS = 2 ** 31 - 1  # a step count: int32, as train.steps


@dataclass(frozen=True)
class Row:
    """One optimizer: its name (``optim.name``), its config section (the dataclass of ``optim.<name>``), the factory
    that builds one ZeRO partition's update from the section's values, and what else it declares."""

    name: str
    section: type
    factory: Callable[[Any, "UpdateContext"], "Update"]
    rank_state: bool = False  # keeps state per rank (Update.rank_state): a checkpoint stores it by global rank
    # why its states must stay on the device, '' where zero.offload_optimizer=cpu may keep them on the host
    device_only: str = ""
    # its factory streams the states from a local disk when the context says so (zero.offload_optimizer=nvme)
    streams_from_disk: bool = False
    # why it cannot run where ZeRO shards the gradients (stages 2-3), '' where it can
    whole_grads: str = ""
    # why it needs more than one rank in its reduction group (dp x cp), '' where one will do
    needs_group: str = ""
    # the optimizers a resume may switch to from its checkpoint (optim.switch_from): their states are its masters
    # and moments, its per-rank state aside
    switches_to: tuple[str, ...] = ()
    # (key of its section, why): keys that name a step of the run, which must come before train.steps
    before_last_step: tuple[tuple[str, str], ...] = ()
    # (checkpoint path, its meta, this run's config): raises UserError where a resume cannot keep what the
    # checkpoint's states assume; None: a same-named optimizer resumes at any layout
    resume_check: Optional[Callable[[Any, dict, Any], None]] = None
    # (config, a pipeline stage's layer ranges) -> the planner's figures of its extra work per step (exchanges,
    # FLOPs beyond the elementwise update); None: none
    plan_step: Optional[Callable[[Any, list], "OptimizerStep"]] = None
    # (elements of the partition, its group's size, whether ZeRO shards the states) -> the bytes of the states one
    # rank keeps once the run is under way, fp32 masters aside (the planner's optimizer bytes): AdamW's two
    # moments by default
    state_bytes: Callable[[int, int, bool], int] = lambda whole, group, sharded: 8 * _share(whole, group, sharded)
    # keeps an fp32 master apart from parameters that are fp32 themselves (the planner adds it where they are)
    master_apart: bool = False


def _share(whole: int, group: int, sharded: bool) -> int:
    """Elements of a partition of ``whole`` one rank keeps states for: its ZeRO shard (padded to the group) or all."""
    return -(-whole // group) if sharded else whole


def _onebit_state_bytes(whole: int, group: int, sharded: bool) -> int:
    """1-bit Adam past its warm-up (``parallel.zero.onebit_adam``): the momentum whole on every rank (AdamW's first
    moment is its slice), a scale-group byte and a worker error per element, the variance on the shard and the
    server error on a 1/group chunk, whatever the stage."""
    return (4 + 1 + 4) * whole + 4 * _share(whole, group, sharded) + 4 * -(-whole // group)


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """``megazero.<module>.<name>``, imported when first called: the optimizers' files import torch, and loading a
    config does without it."""
    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(f"megazero.{module}"), name)(*args)

    return call


def _factory(module: str, name: str) -> Callable[[Any, "UpdateContext"], "Update"]:
    """``parallel.zero.<module>.<name>``: the update's factory."""
    return _lazy(f"parallel.zero.{module}", name)


# ----- AdamW (parallel.zero.adamw) --------------------------------------------------------------------------------
@dataclass
class AdamWSection:
    """``optim.adamw``: Loshchilov & Hutter's AdamW; the learning rate and the decay are train.*'s."""

    beta1: float = 0.9  # the first moment's decay
    beta2: float = 0.95  # the second moment's decay
    eps: float = 1.0e-8  # added to sqrt(v): a gradient that stayed 0 moves by 0, not 0/0

    RANGES = {"eps": _EPS}
    PROBABILITY = ("beta1", "beta2")


# ----- LAMB (parallel.zero.lamb) ----------------------------------------------------------------------------------
@dataclass
class LambSection(AdamWSection):
    """``optim.lamb``: You et al.'s LAMB, AdamW's direction scaled per layer by the trust ratio (AdamW's keys)."""


# ----- Muon (parallel.zero.muon) ----------------------------------------------------------------------------------
@dataclass
class MuonSection:
    """``optim.muon``: Newton-Schulz-orthogonalised momentum on the layers' matrices, AdamW on the rest."""

    momentum: float = 0.95  # the matrices' momentum
    nesterov: bool = True  # Nesterov's form of the momentum
    ns_steps: int = 5  # Newton-Schulz steps per matrix and step
    # the peak learning rate of the parameters AdamW keeps (embeddings, head, vectors), on train.lr's schedule;
    # 0 is train.lr itself
    adamw_lr: float = 0.0
    beta1: float = 0.9  # the first moment's decay of the parameters AdamW keeps
    beta2: float = 0.95  # the second moment's decay of the parameters AdamW keeps
    eps: float = 1.0e-8  # AdamW's eps for the parameters it keeps

    RANGES = {"ns_steps": (1, 100),  # 5 are published; each is three matmuls of the matrix's size
              "adamw_lr": (0.0, 1e9),  # as train.lr
              "eps": _EPS}
    PROBABILITY = ("momentum", "beta1", "beta2")


# ----- 1-bit Adam (parallel.zero.onebit_adam) ---------------------------------------------------------------------
@dataclass
class OnebitAdamSection:
    """``optim.onebit_adam``: Tang et al.'s 1-bit Adam, AdamW's warm-up then a frozen variance and signs."""

    beta1: float = 0.9  # the momentum's decay
    beta2: float = 0.95  # the variance's decay (frozen after the warm-up)
    eps: float = 1.0e-8  # added to sqrt(v); elements with sqrt(v_hat) <= eps are left out of the compression
    # the last step of the full-precision AdamW warm-up; from the next one the variance is frozen and the momentum
    # is all-reduced as signs (Tang et al. 2021 warm up for 15-25% of the run)
    freeze_step: int = 1000

    RANGES = {"eps": _EPS, "freeze_step": (1, _STEPS)}  # rules.py also keeps freeze_step below train.steps
    PROBABILITY = ("beta1", "beta2")


# ----- 1-bit LAMB (parallel.zero.onebit_lamb) ---------------------------------------------------------------------
@dataclass
class OnebitLambSection:
    """``optim.onebit_lamb``: Li et al.'s 1-bit LAMB, LAMB's warm-up then a frozen variance, the momentum as
    signs, and the frozen trust ratios adapted from the reconstructed state."""

    beta1: float = 0.9  # the momentum's decay
    beta2: float = 0.95  # the variance's decay (frozen after the warm-up; the fresh one goes on)
    eps: float = 1.0e-8  # added to sqrt(v); elements with sqrt(v_hat) <= eps are left out of the compression
    freeze_step: int = 1000  # the last step of the full-precision LAMB warm-up
    coeff_beta: float = 0.9  # the decay of each layer's trust-ratio average over the warm-up (1/(1 - it) <= it)
    factor_max: float = 4.0  # the largest factor on a frozen trust ratio
    factor_min: float = 0.5  # the smallest factor on a frozen trust ratio
    factor_threshold: float = 0.1  # the most a factor moves in one step, relative to the last

    RANGES = {"eps": _EPS, "freeze_step": (1, _STEPS), "factor_max": (1.0, 1e3), "factor_min": (1e-3, 1.0),
              "factor_threshold": (0.0, 1.0)}
    PROBABILITY = ("beta1", "beta2", "coeff_beta")


# ----- 0/1 Adam (parallel.zero.zero_one_adam) ----------------------------------------------------------------------
@dataclass
class ZeroOneAdamSection:
    """``optim.zero_one_adam``: Lu et al.'s 0/1 Adam, the variance updated on a thinning schedule then frozen, the
    momentum synchronised as signs, and past the freeze local steps between synchronisations."""

    beta1: float = 0.9  # the momentum's decay
    beta2: float = 0.95  # the variance's decay, at its update steps
    eps: float = 1.0e-8  # added to sqrt(v); elements with sqrt(v) <= eps are left out of the compression
    # the last step that may update the variance (the paper's max T_v, usually the learning rate's warm-up's end);
    # from the next one the ranks take local steps between synchronisations
    var_freeze_step: int = 1000
    var_update_scaler: int = 16  # the variance's interval doubles after this many updates (the paper's kappa)
    local_step_scaler: int = 32768  # past the freeze the synchronisation interval doubles every this many steps
    local_step_clipper: int = 16  # the longest synchronisation interval (the paper's H)
    # how the interval grows: "steps", doubled every local_step_scaler steps (the authors' DeepSpeed schedule);
    # "lr", the largest power of two <= train.lr / the step's rate (the learning-rate-based rule: lr * H <= train.lr)
    local_step_policy: str = "steps"

    RANGES = {"eps": _EPS, "var_freeze_step": (1, _STEPS), "var_update_scaler": (1, _STEPS),
              "local_step_scaler": (1, _STEPS), "local_step_clipper": (1, _STEPS)}
    CHOICES = {"local_step_policy": ("steps", "lr")}
    PROBABILITY = ("beta1", "beta2")


def _zero_one_state_bytes(whole: int, group: int, sharded: bool) -> int:
    """0/1 Adam past its freeze (``parallel.zero.zero_one_adam``): 1-bit Adam's states, plus the accumulator u and
    the frozen denominator whole, and at stage 1 the whole fp32 anchor (the synchronised parameters) and decay
    mask. (fp32 parameters also get a master apart from them at the freeze: ``Row.master_apart``.)"""
    return _onebit_state_bytes(whole, group, sharded) + (8 + (5 if sharded else 0)) * whole


def _onebit_lamb_state_bytes(whole: int, group: int, sharded: bool) -> int:
    """1-bit LAMB past its warm-up (``parallel.zero.onebit_lamb``): 1-bit Adam's states and the fresh variance on
    the shard."""
    return _onebit_state_bytes(whole, group, sharded) + 4 * _share(whole, group, sharded)


_LOCAL_GRADS = "past its warm-up gradients are never reduced, so there is nothing to shard them into and every " \
               "rank needs its whole local gradient"
_COMPRESSES = "it compresses what the ranks exchange; with one rank there is nothing to exchange: use " \
              "optim.name=adamw"

OPTIMIZERS: dict[str, Row] = {
    "adamw": Row("adamw", AdamWSection, _factory("nvme_adamw", "make_adamw_for"), streams_from_disk=True),
    "lamb": Row("lamb", LambSection, _factory("lamb", "make_lamb")),
    "muon": Row("muon", MuonSection, _factory("muon", "make_muon"),
                device_only="its Newton-Schulz iterations run on the device, on matrices gathered there",
                plan_step=_lazy("plan.muon", "muon_step")),
    "onebit_adam": Row("onebit_adam", OnebitAdamSection, _factory("onebit_adam", "make_onebit_adam"),
                       rank_state=True, switches_to=("adamw", "lamb"),
                       device_only="its momentum is compressed and exchanged on the device",
                       whole_grads=_LOCAL_GRADS,
                       before_last_step=(("freeze_step", "is the warm-up's last step, or the run never "
                                                         "compresses; use optim.name=adamw for a run without "
                                                         "compression"),),
                       resume_check=_lazy("train.onebit_resume", "check_onebit_layout"),
                       state_bytes=_onebit_state_bytes),
    "onebit_lamb": Row("onebit_lamb", OnebitLambSection, _factory("onebit_lamb", "make_onebit_lamb"),
                       rank_state=True, switches_to=("lamb", "adamw"),
                       device_only="its momentum is compressed and exchanged on the device",
                       whole_grads=_LOCAL_GRADS, needs_group=_COMPRESSES,
                       before_last_step=(("freeze_step", "is the warm-up's last step, or the run never "
                                                         "compresses; use optim.name=lamb for a run without "
                                                         "compression"),),
                       resume_check=_lazy("train.onebit_resume", "check_onebit_lamb_layout"),
                       state_bytes=_onebit_lamb_state_bytes),
    "zero_one_adam": Row("zero_one_adam", ZeroOneAdamSection, _factory("zero_one_adam", "make_zero_one_adam"),
                         rank_state=True, switches_to=("adamw", "lamb"),
                         device_only="its momentum is compressed and exchanged on the device",
                         whole_grads=_LOCAL_GRADS, needs_group=_COMPRESSES,
                         before_last_step=(("var_freeze_step", "is the variance's last update, or the run never "
                                                               "takes a local step"),
                                           ("local_step_clipper", "bounds the steps between synchronisations, "
                                                                  "which the run must hold")),
                         resume_check=_lazy("train.onebit_resume", "check_zero_one_layout"),
                         state_bytes=_zero_one_state_bytes, master_apart=True),
}
