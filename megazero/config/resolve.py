"""The config resolved: every value ``auto`` or unset stands for, fixed once per run, in its entry point.

``load_config`` returns a config as written and fully checked (megazero.config.rules); :func:`resolve` turns
it into the one that everything downstream reads — the trainer, the plan, the step-time model, fits,
``--simulate`` — none of which resolves again:

* the architecture's auto keys: bias, tie_embeddings, ffn_hidden (models.arch);
* the world: parallel.dp for the world size, checked against tp*pp (rules.world_dp), and
  zero.reshard_after_forward=auto;
* train.precision: auto -> bf16 where the device computes it natively, else fp32 (:func:`precision_for`);
* the kernels: kernels.* auto -> the implementation the device runs (kernels.choice.resolve_kernels);
* log.dir: runs/<config name> when unset;
* parallel.pp_layers: auto -> layer counts balanced by cost (megazero.costs, parallel.balance).

A resolved config resolves to itself: each step fixes only what is still ``auto`` or unset and checks the
rest, so a second :func:`resolve` with the same world and device changes nothing and balances nothing.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from megazero.config.rules import TRITON_GRID_Y, world_dp
from megazero.config.schema import AUTO, Config, KernelsConfig, ModelConfig
from megazero.errors import UserError
from megazero.costs import compute_device, pipeline_costs
from megazero.models import arch
from megazero.parallel.balance import balance_layers


class Memo(Protocol):
    """What resolve asks of a memo (megazero.plan.memo.PlanMemo): a call remembered across a search's configs."""

    def call(self, fn: Callable, *args: Any, key: Optional[tuple] = None, **kwargs: Any) -> Any: ...


def resolve(cfg: Config, world_size: int, device_type: str, *, planned: bool = False,
            memo: Optional[Memo] = None) -> Config:
    """Fix every derived value of ``cfg`` (checked by load_config or rules.validate) for ``world_size`` ranks
    on ``device_type`` (cuda or cpu); returns ``cfg``. Errors are one line (the world against the layout, a
    kernel this machine cannot run), raised before any process group.

    ``planned``: the run is planned here, not started (--dry-run, the layout search): ``device_type`` is the
    device it is planned for (megazero.costs.compute_device: a login node plans the GPU run), kernels.* auto
    take that device's choice without CUDA being here, and an explicit kernel is kept as named, to be
    checked where the run starts. ``memo`` (a :class:`Memo`) remembers the layer balancing
    across the configs of one layout search."""
    resolve_arch(cfg.model)
    p = cfg.parallel
    p.dp = world_dp(cfg, world_size)
    if cfg.zero.reshard_after_forward == AUTO:
        # A pipeline stage runs m forwards and m backwards per step: resharding after every forward would
        # gather each layer 2m times per step instead of once (torchtitan reshards only without pp).
        cfg.zero.reshard_after_forward = p.pp == 1
    if cfg.train.precision == AUTO:
        cfg.train.precision = precision_for(device_type, planned)[0]
    _resolve_kernels(cfg, device_type, planned)
    if not cfg.log.dir:
        cfg.log.dir = str(Path("runs") / cfg.name)
    if p.pp_layers == AUTO:  # last: the costliest step
        costs = pipeline_costs(cfg.model, p.tp, cfg.train.precision, compute_device(cfg.launch.device))
        args = (cfg.model.layers, p.pp, costs, p.virtual_stages)
        p.pp_layers = memo.call(balance_layers, *args) if memo is not None else balance_layers(*args)
    return cfg


def precision_for(device_type: str, planned: bool = False) -> tuple[str, str]:
    """train.precision=auto on ``device_type``: (the precision, why). bf16 halves the bytes and is what GPUs
    train in, but only a device with bf16 arithmetic gains from it: a GPU that reports bf16 support (Ampere on),
    or a CPU with AMX tiles (torch.cpu._is_amx_tile_supported). Elsewhere the CPU converts every bf16 operand
    to fp32 and back, slower than fp32 itself (configs/tiny-moe.yaml on 2 AVX-512 cores: ~1.2k tokens/s in
    bf16 against ~1.8k in fp32), so fp32. A planned GPU run (``planned``) takes bf16 without a GPU here."""
    import torch  # once the config is checked

    if device_type == "cuda":
        if planned or torch.cuda.is_bf16_supported():
            return "bf16", "this GPU computes bf16 natively"
        return "fp32", "this GPU does not compute bf16 natively"
    if torch.cpu._is_amx_tile_supported():
        return "bf16", "this CPU has AMX tiles for bf16 matrix products"
    return "fp32", "this CPU has no AMX tiles: bf16 would be converted to fp32 and back, slower than fp32"


def resolve_arch(m: ModelConfig) -> ModelConfig:
    """Fix the values ``auto``/unset mean for the architecture (``models.arch``): GPT-2 has biases, a tied head
    and a 4h MLP; Llama none, an untied head and a SwiGLU MLP of 8h/3 rounded up to a multiple of 256. For a
    model section alone (a checkpoint's, a benchmark's); a run's config gets it from :func:`resolve`."""
    m.bias, m.tie_embeddings, m.ffn_hidden = arch.has_bias(m), arch.tied(m), arch.ffn_hidden(m)
    return m


def _resolve_kernels(cfg: Config, device_type: str, planned: bool) -> None:
    """kernels.* for the device. Planned, only the auto keys are resolved (by the same function, with the
    explicit ones standing in as torch, which every device runs): whether Triton can run is a question for
    the machine that runs."""
    from megazero.kernels.choice import resolve_kernels  # imports torch: only once the config is checked

    k = cfg.kernels
    if cfg.train.fp8 != "none" and device_type == "cuda" and not planned:
        import torch

        if torch.cuda.get_device_capability() < (8, 9):
            major, minor = torch.cuda.get_device_capability()
            raise UserError(f"{cfg.source}: train.fp8={cfg.train.fp8!r} needs a GPU with FP8 matmuls (sm_89 or "
                            f"later: Ada, Hopper), this one is sm_{major}{minor}; valid here: none")
    auto_attention = k.attention == AUTO
    if not planned:
        resolve_kernels(k, device_type, cfg.model.head_width, cfg.data.document_mask)
    else:
        names = [f.name for f in dataclasses.fields(KernelsConfig)]
        probe = KernelsConfig(**{n: AUTO if getattr(k, n) == AUTO else "torch" for n in names})
        resolve_kernels(probe, device_type, cfg.model.head_width, cfg.data.document_mask)
        for n in names:
            if getattr(k, n) == AUTO:
                setattr(k, n, getattr(probe, n))
    # auto chose Triton (a document mask on a GPU), but its grid cannot hold micro_batch*heads/tp programs
    # (megazero.config.rules refuses an explicit request): SDPA with the dense mask instead
    if auto_attention and k.attention == "triton" and \
            cfg.train.micro_batch * cfg.model.heads // cfg.parallel.tp > TRITON_GRID_Y:
        k.attention = "torch"


def planned_world_size(cfg: Config, launcher_world: int) -> int:
    """The world a dry run or a simulation resolves for: parallel.world_size when set; else the launcher's when
    launched (a dry run under torchrun or srun checks the config against the world it would get); else
    tp*pp*dp*cp when dp is explicit; else 1."""
    p = cfg.parallel
    if p.world_size > 0:
        return p.world_size
    if p.dp != AUTO and launcher_world == 1:
        return p.tp * p.pp * p.dp * p.cp
    return launcher_world
