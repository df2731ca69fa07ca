"""Layout-independent initialisation: each parameter's value depends only on (seed, global name, shape, config).

The full tensor is drawn from a generator seeded by the parameter's name and this tp rank keeps its slice, so a
model starts the same at any (tp, pp, dp, ZeRO stage) and a checkpoint or parity test can compare by name.
The scheme is GPT-2's (Radford et al. 2019, section 2.3), used for Llama too.
"""
from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from megazero.models.stage import GPT

if TYPE_CHECKING:
    from megazero.models.config import ModelConfig

RESIDUAL_PROJECTIONS = ("attn.proj.weight", "mlp.fc2.weight", "mlp.down.weight", "mlp.shared.down.weight")
NORMS = ("ln1", "ln2", "final_norm", "q_norm", "k_norm")

InitialValues = Callable[[str, tuple[int, ...]], Tensor]  # (name, full shape) -> the full float32 value


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def initial_value(name: str, full_shape: tuple[int, ...], seed: int, cfg: ModelConfig) -> Tensor:
    """The full (unsharded) float32 initial value of the parameter called ``name``.

    GPT-2 scheme: N(0, init_std) for weights and embeddings, residual output
    projections scaled by 1/sqrt(2 * layers) (two residual additions per block),
    zero biases, LayerNorm weight 1. Depends only on (seed, name, shape, cfg).
    """
    module = name.split(".")[-2]
    if ".experts." in name and name.endswith(".down"):  # an expert's output projection is a residual one
        return torch.empty(full_shape).normal_(0.0, cfg.init_std / math.sqrt(2 * cfg.layers),
                                               generator=_generator(seed, name))
    if name.endswith(".bias"):
        return torch.zeros(full_shape)
    if module in NORMS:
        return torch.ones(full_shape)
    std = cfg.init_std
    if name.endswith(RESIDUAL_PROJECTIONS):
        std = std / math.sqrt(2 * cfg.layers)
    return torch.empty(full_shape).normal_(0.0, std, generator=_generator(seed, name))


def initial_tp_value(model: GPT, name: str, seed: int | InitialValues) -> Tensor:
    """This tp rank's slice of the initial value of the parameter ``name`` of ``model`` (CPU, float32).

    ``seed``: the seed of :func:`initial_value`, or a function giving each full value (an imported
    Hugging Face model's weights, ``train.init_from``)."""
    module_name, _, pname = name.rpartition(".")
    module = model.get_submodule(module_name)
    tp_rank, tp_size = getattr(module, "tp_rank", 0), getattr(module, "tp_size", 1)
    p = getattr(module, pname)
    if getattr(p, "ep_split_dim", None) is not None:
        return _local_experts(model, name, module, p, seed)
    dim = p.tp_split_dim
    pieces = tp_size // getattr(p, "tp_replicas", 1)  # replicated k/v heads: tp/replicas distinct pieces
    full_shape = list(p.shape)
    if dim is not None:
        full_shape[dim] *= pieces
    if callable(seed):
        value = seed(name, tuple(full_shape))
        assert tuple(value.shape) == tuple(full_shape), (name, tuple(value.shape), full_shape)
    else:
        value = initial_value(name, tuple(full_shape), seed, model.cfg)
    if dim is not None and pieces > 1:
        value = value.chunk(pieces, dim=dim)[tp_rank * pieces // tp_size]
    return value


def expert_name(name: str, expert: int) -> str:
    """The logical name of one expert's matrix of a stacked expert parameter: ``layers.3.mlp.experts.5.gate``
    for expert 5 of ``layers.3.mlp.experts.gate`` (what its initial value is drawn by, and an import reads)."""
    prefix, _, kind = name.rpartition(".")
    return f"{prefix}.{expert}.{kind}"


def _fake(p: Tensor) -> bool:
    """Under ``--simulate``'s fake mode (the parameter fake, or still on the meta device for ZeRO-3 to create
    while the mode is on): shapes without values, so none need drawing."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(p) or detect_fake_mode() is not None


def _local_experts(model: GPT, name: str, module, p, seed: int | InitialValues) -> Tensor:
    """This ep rank's experts of a stacked expert parameter, each drawn by its own name: no rank builds the
    whole stack (E of them), and the values do not depend on how the experts are split. On fake tensors
    (``--simulate``) no values exist: the same bytes (every expert drawn, then their stack) in two ops, not
    3 per expert (65,536 experts took minutes)."""
    if _fake(p) and not callable(seed):
        drawn = torch.empty(tuple(p.shape))
        return drawn.clone()
    values = []
    for e in range(module.first, module.first + p.shape[0]):
        one = expert_name(name, e)
        if callable(seed):
            v = seed(one, tuple(p.shape[1:]))
            assert tuple(v.shape) == tuple(p.shape[1:]), (one, tuple(v.shape), tuple(p.shape[1:]))
        else:
            v = initial_value(one, tuple(p.shape[1:]), seed, model.cfg)
        values.append(v)
    return torch.stack(values)


@torch.no_grad()
def init_parameters(model: GPT, seed: int | InitialValues) -> None:
    """Set every parameter to its layout-independent initial value (this rank's tp slice of it)."""
    for name, p in model.named_parameters():
        p.copy_(initial_tp_value(model, name, seed))
