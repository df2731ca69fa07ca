"""A run's checkpoint state: what a resume needs, under logical names, saved only when finite and loaded
only into the architecture it was written by."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from megazero.checkpoint import store as checkpoint
from megazero.checkpoint.architecture import model_differences
from megazero.checkpoint.layout import complete_replicas, logical
from megazero.checkpoint.writer import CheckpointWriter
from megazero.config.schema import Config, ModelConfig
from megazero.errors import NonFiniteStop, UserError
from megazero.interop.hf_layout import model_config
from megazero.train.onebit_resume import check_rank_state_stored
from megazero.train.resume_changes import check_built_data, resume_record
from megazero.parallel.loss_scale import LossScaler
from megazero.parallel.topology import Grid
from megazero.parallel.zero import ZeroOptimizer


def state_tensors(zero: ZeroOptimizer, named_params: list[tuple[str, nn.Parameter]],
                  grid: Grid, buffers: list[tuple[str, torch.Tensor]] = (),
                  step: Optional[int] = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Everything a resume needs that is a tensor, under logical names (layout-free), and the per-parameter
    views it was made from (for loading back into the ZeRO buffers). ``buffers``: state that is not a
    parameter (a router's selection bias), the same on every rank that holds it, loaded in place. What is the
    rank's alone as of optimizer step ``step`` (default: the optimizer's; 1-bit Adam's error buffers) is stored
    under ``rank/<global rank>/``: a resume at the same layout only (``megazero.train.resume_changes``)."""
    params = dict(named_params)
    exported = zero.export_state()
    state = {f"buffer/{n}": t for n, t in buffers}
    own = zero.rank_state(zero.step_count if step is None else step)
    state.update({f"rank/{grid.rank}/{k}": t for k, t in own.items()})
    for n, kinds in exported.items():
        p = params[n]
        state[f"model/{n}"] = logical(kinds["param"], p, grid)
        for k in ("master", "exp_avg", "exp_avg_sq"):
            state[f"optim/{n}/{k}"] = logical(kinds[k], p, grid)
    return state, exported


def save_state(writer: CheckpointWriter, cfg: Config, zero: ZeroOptimizer,
               named_params: list[tuple[str, nn.Parameter]], grid: Grid, scaler: LossScaler, step: int,
               consumed_samples: int, data: Any, run_id: str, device: torch.device,
               buffers: list[tuple[str, torch.Tensor]] = (), extra_meta: Optional[dict] = None) -> Path:
    """Checkpoint this step (in the background with train.async_save). A state holding a non-finite value is
    never saved: keep_last would rotate the last good checkpoint away. ``data``: the run's ``GPTData``, whose
    tokenizer and files as built are recorded (no file is read here). ``extra_meta``: more of the run's
    state for meta.json (train.on_spike's window and counts)."""
    tokenizer = getattr(data, "tokenizer_path", None)
    meta = {"consumed_samples": consumed_samples, "optimizer_step": zero.step_count,
            "tokenizer": str(Path(tokenizer).resolve()) if tokenizer is not None else None,
            "loss_scaler": scaler.state(),
            "config": cfg.to_dict(),
            **resume_record(cfg, getattr(data, "tokenizer_fingerprint", None), getattr(data, "stamps", ())),
            "rng": "dropout streams are derived from (train.seed, step, grid coordinates)", **(extra_meta or {})}
    state, _ = state_tensors(zero, named_params, grid, [(n, t.clone()) for n, t in buffers])
    bad = torch.zeros((), device=device)
    for t in state.values():
        local = t.to_local() if hasattr(t, "to_local") else t
        bad = torch.maximum(bad, torch.isfinite(local).logical_not().any().float().to(bad.device))
    zero.world.all_reduce(bad, op=dist.ReduceOp.MAX, tag="checkpoint")
    if bad.item():
        raise NonFiniteStop(f"step {step}: the model state holds non-finite values; not saved, so the "
                            f"latest checkpoint is the last good one")
    return writer.save(step, state, meta, run_id)


def check_architecture(path: Path, model: ModelConfig) -> None:
    """A resume keeps the architecture: the checkpoint's model, compared as resolved values, must be ours."""
    theirs = model_config(checkpoint.read_meta(path).get("config", {}).get("model", {}))
    diffs = model_differences(theirs, model, ModelConfig.ARCHITECTURE)
    if diffs:
        named = ", ".join(f"model.{key} is {there!r} there and {ours!r} here" for key, there, ours in diffs)
        raise UserError(f"checkpoint {path}: {named}; a resume keeps the architecture "
                        f"({', '.join(ModelConfig.ARCHITECTURE)})")


def load_state(path: Path, cfg: Config, zero: ZeroOptimizer, named_params: list[tuple[str, nn.Parameter]],
               grid: Grid, scaler: LossScaler, data: Any = None,
               buffers: list[tuple[str, torch.Tensor]] = ()) -> tuple[dict, Optional[str]]:
    """Load a checkpoint into the ZeRO buffers and the scaler; returns its meta (step, consumed_samples) and the
    line that names the data settings changed since it (None: none, or train.resume_changes=allow).
    ``data``: the run's ``GPTData``, whose tokenizer must be the checkpoint's."""
    check_architecture(path, cfg.model)
    changed = check_built_data(path, cfg, getattr(data, "tokenizer_fingerprint", None),
                               getattr(data, "stamps", None))
    step = int(checkpoint.read_meta(path)["optimizer_step"])
    state, exported = state_tensors(zero, named_params, grid, buffers, step)
    stored = set(checkpoint.stored_tensors(path))
    own = f"rank/{grid.rank}/"
    missing = [k for k in state if k.startswith(own) and k not in stored]  # an older megazero's checkpoint
    for key in missing:
        if zero.rebuild_rank_state(key[len(own):], step):
            del state[key]
    check_rank_state_stored(path, [k for k in state if k.startswith("rank/")], stored)
    left = [k for k in missing if k in state]
    if left:
        raise UserError(f"checkpoint {path}: holds no {left[0]!r} ({len(left)} of this rank's optimizer states "
                        f"missing), which this optimizer needs past optimizer step {step} and cannot rebuild: "
                        f"written by an older megazero or another optim setting; resume with its settings, or "
                        f"start afresh")
    meta = checkpoint.load(path, state)
    complete_replicas(exported, dict(named_params), grid)
    zero.import_state(exported, int(meta["optimizer_step"]), int(meta.get("step", meta["optimizer_step"])))
    if "loss_scaler" in meta:
        scaler.load(meta["loss_scaler"])
    return meta, changed
