"""The one place an engine is assembled: model chunks, ZeRO, the pipeline executor, the schedules, the loss scaler.

``build_engine`` turns a resolved config into what one rank trains with. The trainer, ``--simulate`` (through
the trainer), the tests and the benchmarks get their engine here; a benchmark or test that brings its own bare
model takes the pieces (``make_zero``, ``make_executor``, ``make_schedules``, ``make_scaler``) so every
executor and optimizer in the repository is built the same way.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from megazero.engine.compile_blocks import compile_blocks
from megazero.engine.fp8_layers import mark_fp8
from megazero.config.schema import Config, OptimConfig, ZeroConfig
from megazero.models.build import build_gpt
from megazero.models.init import InitialValues, initial_tp_value
from megazero.models.llama import kv_replicas_needed
from megazero.parallel.loss_scale import LossScaler
from megazero.parallel.pipeline import PipelineExecutor, partition_layers
from megazero.parallel.sequence import SequenceSplit
from megazero.parallel.schedules import Action, build_schedule, virtual_stage
from megazero.parallel.topology import Grid
from megazero.parallel.zero import DTYPES, ZeroOptimizer
from megazero.parallel.zero.nvme_adamw import NvmeSettings
from megazero.parallel.zero.registry import OPTIMIZERS
from megazero.parallel.zero.policy import StagePolicy


@dataclass
class Engine:
    """What one rank trains with. ``named_params``: the trainable parameters of its chunks under their global
    names, as ZeRO left them (stage 3 may have given the modules new Parameter objects)."""

    chunks: list[nn.Module]
    zero: ZeroOptimizer
    executor: PipelineExecutor
    schedule: list[Action]
    eval_schedule: list[Action]
    scaler: LossScaler
    named_params: list[tuple[str, nn.Parameter]]
    tokens_per_step: int  # the global batch's tokens: each microbatch's loss sum is divided by it
    # state a resume needs that is not a parameter, under global names: the sigmoid routers' selection biases
    named_buffers: list = field(default_factory=list)


def initial_values(cfg: Config) -> int | InitialValues:
    """Where the weights start: the seed of megazero's initialisation, or the Hugging Face model folder of
    ``train.init_from`` (its config checked against ``model``; each tensor read when its parameter is made)."""
    if not cfg.train.init_from:
        return cfg.train.seed
    from megazero.interop.hf_import import open_hf_model

    weights = open_hf_model(cfg.train.init_from, cfg.model, cfg.train.init_unused)
    return lambda name, shape: weights.value(name)


def autocast_for(precision: str, device_type: str) -> Callable[[], contextlib.AbstractContextManager]:
    """The forward's autocast context for a precision (fp32: none)."""
    if precision in ("bf16", "fp16"):
        return lambda: torch.autocast(device_type=device_type, dtype=DTYPES[precision])
    return contextlib.nullcontext


def make_executor(chunks: list[nn.Module], grid: Grid, device: torch.device, micro_batch: int, seq_len: int,
                  hidden: int, precision: str, tokens_per_step: int, overlap_p2p: bool = False,
                  sequence: Optional[SequenceSplit] = None) -> PipelineExecutor:
    """The pipeline executor over this rank's chunks; the activations between stages are (micro_batch, seq,
    hidden), seq split over cp (its chunks) and over tp under sequence parallelism. ``sequence``: how a
    microbatch's rows become this rank's tokens (default: its cp chunks, no document mask)."""
    seq = seq_len // grid.cp // (grid.tp if chunks[0].sequence_parallel else 1)
    return PipelineExecutor(chunks, grid, (micro_batch, seq, hidden), DTYPES[precision], device, tokens_per_step,
                            autocast_for(precision, device.type), overlap_p2p=overlap_p2p, sequence=sequence)


def make_schedules(kind: str, grid: Grid, microbatches: int, virtual_stages: int = 1,
                   overlap_p2p: bool = False) -> tuple[list[Action], list[Action]]:
    """This rank's training schedule and its forward-only (evaluation) schedule."""
    train = build_schedule(kind, grid.pp, microbatches, virtual_stages, overlap_p2p=overlap_p2p)[grid.pp_rank]
    evaluation = build_schedule(kind, grid.pp, microbatches, virtual_stages, forward_only=True)[grid.pp_rank]
    return train, evaluation


def make_zero(chunks: list[nn.Module], grid: Grid, z: ZeroConfig, precision: str, weight_decay: float,
              device: Optional[torch.device] = None, adam_impl: str = "torch",
              initial_value: Optional[Callable[[nn.Parameter], Tensor]] = None,
              overlap_param_gather: bool = True, optim: Optional[OptimConfig] = None,
              lr: float = 0.0, steps: int = 0) -> ZeroOptimizer:
    """ZeRO over the chunks as ``z`` says (its reshard_after_forward resolved), with the update of ``optim``'s row
    of ``parallel.zero.registry`` built from its section (default: AdamW with betas (0.9, 0.95)).
    ``overlap_param_gather=False`` waits for stages 1-2's post-step gathers at the end of the step (a benchmark's
    baseline). ``lr``: train.lr, the peak each step's rate is scheduled from (Muon's optim.muon.adamw_lr is
    relative to it). ``steps``: train.steps, the run's last step (0: not known)."""
    o = optim if optim is not None else OptimConfig()
    row = OPTIMIZERS[o.name]
    update = partial(row.factory, getattr(o, o.name))
    assert not isinstance(z.reshard_after_forward, str), "zero.reshard_after_forward: megazero.config.resolve.resolve() first"
    nvme = None
    if z.offload_optimizer == "nvme":  # a folder per rank: ranks of one node share the disk, never a file
        nvme = NvmeSettings(Path(z.nvme_path) / f"rank_{grid.rank}", int(z.nvme_buffer_mb * 2 ** 20))
    return ZeroOptimizer(chunks, grid, z.stage, precision, weight_decay, update, z.bucket_mb, z.reshard_after_forward,
                         z.offload_optimizer, z.offload_params, adam_impl=adam_impl, device=device,
                         initial_value=initial_value, grad_dtype=z.grad_dtype,
                         overlap_param_gather=overlap_param_gather, peak_lr=lr, nvme=nvme,
                         last_step=steps)


def make_scaler(precision: str) -> LossScaler:
    """The dynamic loss scaler: on under fp16 only (DeepSpeed's defaults)."""
    return LossScaler(enabled=precision == "fp16")


def build_chunks(cfg: Config, grid: Grid, device: torch.device,
                 values: int | InitialValues) -> list[nn.Module]:
    """This rank's model chunks: chunk c is virtual stage c*pp + pp_rank. Under a policy that shards the
    parameters they stay on the meta device: ZeRO creates them itself, one bucket at a time."""
    par = cfg.parallel
    v = par.virtual_stages
    ranges = partition_layers(cfg.model.layers, grid.pp * v, par.pp_layers)
    last_vs = grid.pp * v - 1
    lazy = StagePolicy.of(cfg.zero.stage).shard_params
    # the tp ranks that share a k/v head when there are fewer than tp (a collective: every rank builds it)
    kv_replicas = grid.tp_replica_comm(kv_replicas_needed(cfg.model, grid.tp))
    chunks = []
    for c in range(v):
        vs = virtual_stage(grid.pp_rank, c, grid.pp)
        chunks.append(build_gpt(cfg.model, values, device=device, tp=grid.tp_comm, layer_ids=ranges[vs],
                                first_stage=vs == 0, last_stage=vs == last_vs,
                                sequence_parallel=par.sequence_parallel, attention_impl=cfg.kernels.attention,
                                materialise=not lazy, kv_replicas=kv_replicas, tp_overlap=par.tp_overlap,
                                ep=grid.ep_comm, cp=grid.cp_comm, cp_mode=par.cp_mode,
                                loss_chunk=cfg.train.loss_chunk_tokens, norm_impl=cfg.kernels.norm))
        mark_fp8(chunks[-1], cfg.train.fp8, cfg.model.layers)
    return chunks


def sequence_split(cfg: Config, grid: Grid, eos_id: int = -1) -> SequenceSplit:
    """How each microbatch becomes this rank's tokens: its cp chunks, and the documents when masked. The data
    refuses a corpus without end-of-text tokens under the mask; ``eos_id`` -1 is a stand-in for data
    (``--simulate``'s zero ids), which then runs unmasked."""
    d = cfg.data
    documents = (d.document_mask or d.reset_positions) and eos_id >= 0
    return SequenceSplit(grid.cp_comm, eos_id if documents else None, d.document_mask and documents,
                         d.reset_positions and documents)


def build_engine(cfg: Config, grid: Grid, device: torch.device, overlap_param_gather: bool = True,
                 eos_id: int = -1) -> Engine:
    """This rank's engine for a resolved config (world, kernels): every rank of the grid calls it together
    (building the model's communicators is collective). ``eos_id``: the data's end-of-text token, which closes
    a document under data.document_mask / reset_positions."""
    torch.manual_seed(cfg.train.seed)
    values = initial_values(cfg)
    chunks = build_chunks(cfg, grid, device, values)
    if cfg.train.compile:
        compile_blocks(chunks)
    origin = {p: (m, n) for m in chunks for n, p in m.named_parameters()}
    t, par = cfg.train, cfg.parallel
    zero = make_zero(chunks, grid, cfg.zero, t.precision, t.weight_decay, device, cfg.kernels.adam,
                     initial_value=lambda p: initial_tp_value(*origin[p], values),
                     overlap_param_gather=overlap_param_gather, optim=cfg.optim, lr=t.lr, steps=t.steps)
    named = [(n, p) for m in chunks for n, p in m.named_parameters() if p.requires_grad]
    tokens = t.global_batch * cfg.model.seq_len
    executor = make_executor(chunks, grid, device, t.micro_batch, cfg.model.seq_len, cfg.model.hidden, t.precision,
                             tokens, overlap_p2p=par.overlap_p2p, sequence=sequence_split(cfg, grid, eos_id))
    schedule, eval_schedule = make_schedules(par.schedule, grid, cfg.microbatches, par.virtual_stages,
                                             overlap_p2p=par.overlap_p2p)
    buffers = [(f"layers.{i}.mlp.router.expert_bias", mlp.router.expert_bias) for c in chunks
               for i, mlp in (c.moe_layers() if hasattr(c, "moe_layers") else []) if mlp.router.expert_bias is not None]
    return Engine(chunks, zero, executor, schedule, eval_schedule, make_scaler(t.precision), named, tokens, buffers)
