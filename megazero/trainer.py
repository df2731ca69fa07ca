"""The training step and loop: schedule -> gradient reduction -> clip -> AdamW -> metrics -> checkpoint.

The loss of a step is the mean over every token of the global batch, whatever
the layout: each microbatch's summed token loss is divided by the global
token count before backward, and gradients are summed across data-parallel
ranks. That makes a dp=k run follow the dp=1 run (DESIGN: layout invariance).
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megazero import checkpoint, optim
from megazero.config import Config
from megazero.data import GPTData, build_data
from megazero.errors import UserError
from megazero.metrics import MetricsLogger, memory_gb, model_flops_per_token, peak_tflops
from models.gpt import build_gpt
from parallel.topology import Grid, coords_to_rank


def step_seed(seed: int, step: int, *coords: int) -> int:
    """The RNG seed of one step at one place of the grid: dropout masks are a function of
    (seed, step, coordinates), so a resumed run draws exactly the masks the uninterrupted run would have."""
    key = ":".join(str(v) for v in (seed, step, *coords)).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


def load_data_everywhere(cfg: Config, grid: Grid, is_builder: bool) -> GPTData:
    """Build the dataset on one rank per node, let the others load it; an input error stops every rank."""
    m, t = cfg.model, cfg.train

    def noop() -> None:
        pass

    data, error = None, None
    if is_builder:
        try:
            data = build_data(cfg.data, m.vocab_size, m.seq_len, t.seed, is_builder=True, barrier=noop)
        except UserError as e:
            error = str(e)
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise UserError(error)
    if data is None:
        data = build_data(cfg.data, m.vocab_size, m.seq_len, t.seed, is_builder=False, barrier=noop)
    return data


class Trainer:
    """One rank's share of a run: its stage of the model, its data share, its optimizer."""

    def __init__(self, cfg: Config, grid: Grid, device: torch.device, is_builder: bool = True):
        self.cfg, self.grid, self.device = cfg, grid, device
        if grid.pp > 1:
            raise UserError(f"{cfg.source}: parallel.pp={grid.pp}: this version has no pipeline parallelism; "
                            f"valid: parallel.pp=1")
        self.data = load_data_everywhere(cfg, grid, is_builder)
        torch.manual_seed(cfg.train.seed)
        self.model = build_gpt(cfg.model, cfg.train.seed, device=device, tp=grid.tp_comm,
                               first_stage=grid.is_first_stage, last_stage=grid.is_last_stage,
                               sequence_parallel=cfg.parallel.sequence_parallel)
        self.named_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        self.optimizer = optim.build_adamw(self.named_params, cfg.train.lr, cfg.train.weight_decay)
        self.step = 0
        self.consumed_samples = 0
        writer_rank = coords_to_rank(grid.pp - 1, 0, 0, grid.tp, grid.dp)
        self.is_writer = grid.rank == writer_rank
        self.ckpt_root = Path(cfg.log.dir) / "checkpoints"
        self.tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
        self.flops_per_step = model_flops_per_token(cfg.model) * self.tokens_per_step
        self.peak = None  # measured lazily, only where it is reported

    # ----- one step -------------------------------------------------------------------------
    def _autocast(self):
        if self.cfg.train.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_backward(self, microbatches: list[torch.Tensor]) -> torch.Tensor:
        """Run every microbatch forward and backward; returns this rank's summed token loss."""
        total = torch.zeros((), device=self.device)
        for mb in microbatches:
            mb = mb.to(self.device, non_blocking=True)
            with self._autocast():
                token_loss = self.model(mb[:, :-1], mb[:, 1:])
            loss_sum = token_loss.float().sum()
            (loss_sum / self.tokens_per_step).backward()
            total += loss_sum.detach()
        return total

    def train_step(self) -> dict:
        cfg, grid = self.cfg, self.grid
        # shared by the tp group (replicated activations) / this tp rank's own (split activations)
        torch.manual_seed(step_seed(cfg.train.seed, self.step, grid.pp_rank, grid.dp_rank))
        self.model.rng.seed(step_seed(cfg.train.seed, self.step, grid.pp_rank, grid.dp_rank, grid.tp_rank))
        lr = optim.lr_at(self.step, cfg.train.lr, cfg.train.min_lr, cfg.train.warmup_steps, cfg.train.steps)
        optim.set_lr(self.optimizer, lr)
        self.model.train()
        microbatches = self.data.train_microbatches(self.consumed_samples, grid.dp_rank, grid.dp,
                                                    cfg.train.micro_batch, cfg.train.global_batch)
        assert len(microbatches) == cfg.microbatches
        loss_sum = self.forward_backward(microbatches)
        optim.allreduce_gradients([p for p in self.params if p.sequence_parallel], grid.tp_comm)
        optim.allreduce_gradients(self.params, grid.dp_comm)
        grid.dp_comm.all_reduce(loss_sum, tag="loss")
        norm = optim.grad_norm(self.params, grid.tp_comm, (grid.pp_comm,))
        optim.clip_gradients(self.params, norm, cfg.train.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.consumed_samples += cfg.train.global_batch
        return {"loss": (loss_sum / self.tokens_per_step).item(), "lr": lr, "grad_norm": norm.item()}

    @torch.no_grad()
    def evaluate(self) -> dict:
        cfg, grid = self.cfg, self.grid
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for b in range(cfg.train.eval_batches):
            for mb in self.data.val_microbatches(b, grid.dp_rank, grid.dp, cfg.train.micro_batch,
                                                 cfg.train.global_batch):
                mb = mb.to(self.device)
                with self._autocast():
                    total += self.model(mb[:, :-1], mb[:, 1:]).float().sum()
        grid.dp_comm.all_reduce(total, tag="loss")
        val = (total / (self.tokens_per_step * cfg.train.eval_batches)).item()
        return {"val_loss": val, "val_ppl": math.exp(min(val, 50.0))}

    # ----- checkpoints ------------------------------------------------------------------------
    def _logical(self, local: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
        """A tp shard as a DTensor over the tp mesh, so DCP stores (and reshards) the whole parameter."""
        if param.tp_split_dim is None or self.grid.tp == 1:
            return local
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(local, self.grid.mesh["tp"], [Shard(param.tp_split_dim)], run_check=False)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Everything a resume needs that is a tensor, under logical names (layout-free)."""
        state = {f"model/{n}": self._logical(p.data, p) for n, p in self.named_params}
        for n, p in self.named_params:
            s = self.optimizer.state.get(p)
            if s is None:  # before the first step: materialise the zero state so a resume is exact
                s = self.optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                               "exp_avg_sq": torch.zeros_like(p)}
            state[f"optim/{n}/exp_avg"] = self._logical(s["exp_avg"], p)
            state[f"optim/{n}/exp_avg_sq"] = self._logical(s["exp_avg_sq"], p)
        return state

    def save(self) -> Path:
        meta = {"consumed_samples": self.consumed_samples, "optimizer_step": self.step,
                "config": self.cfg.to_dict(),
                "rng": "dropout streams are derived from (train.seed, step, grid coordinates)"}
        return checkpoint.save(self.ckpt_root, self.step, self.state_tensors(), meta, self.cfg.train.keep_last)

    def resume_path(self) -> Optional[Path]:
        r = self.cfg.train.resume
        if r == "none":
            return None
        if r == "auto":
            return checkpoint.latest_checkpoint(self.ckpt_root)
        return Path(r)

    def load(self, path: Path) -> None:
        meta = checkpoint.load(path, self.state_tensors())
        if meta.get("config", {}).get("model") and meta["config"]["model"] != self.cfg.to_dict()["model"]:
            raise UserError(f"checkpoint {path}: its model section differs from this config's")
        self.step = int(meta["step"])
        self.consumed_samples = int(meta["consumed_samples"])
        for n, p in self.named_params:
            self.optimizer.state[p]["step"] = torch.tensor(float(meta["optimizer_step"]))

    # ----- the loop ---------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        cfg = self.cfg
        path = self.resume_path()
        if path is not None:
            self.load(path)
            if self.is_writer:
                print(f"resumed from {path} at step {self.step}", flush=True)
        logger = MetricsLogger(cfg.log.dir, cfg.train.steps, self.is_writer, cfg.log.tensorboard,
                               append=path is not None, start_step=self.step)
        if self.is_writer:
            print(f"{self.grid}\nlogs: {Path(cfg.log.dir).resolve()}  "
                  f"(tensorboard --logdir {cfg.log.dir})", flush=True)
            self.peak = peak_tflops(self.device, cfg.train.precision, cfg.log.peak_tflops)
        history = []
        stop_at = cfg.train.steps
        if cfg.train.exit_after:
            stop_at = min(stop_at, self.step + cfg.train.exit_after)
        window_time, window_steps = 0.0, 0
        while self.step < stop_at:
            t0 = time.perf_counter()
            record = self.train_step()  # .item() on the loss waits for the device: the time is real
            window_time += time.perf_counter() - t0
            window_steps += 1
            step = self.step
            if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == cfg.train.steps):
                record.update(self.evaluate())
            if step % cfg.log.every == 0 or step == cfg.train.steps:
                dt = window_time / window_steps
                tflops = self.flops_per_step / dt / self.grid.world_size / 1e12
                record.update({"tokens_per_s": self.tokens_per_step / dt, "tflops": tflops,
                               "mfu": tflops / self.peak if self.peak else float("nan"),
                               "memory_gb": memory_gb(self.device)})
                logger.log(step, record)
                window_time, window_steps = 0.0, 0
            history.append({"step": step, **record})
            if (cfg.train.save_every and step % cfg.train.save_every == 0) or step == stop_at:
                self.save()
        logger.close()
        if self.is_writer:
            print(f"done: {self.step} steps; metrics in {Path(cfg.log.dir) / 'metrics.jsonl'}, "
                  f"checkpoints in {self.ckpt_root}", flush=True)
        return history
