"""The training step and loop: schedule -> gradient reduction -> clip -> AdamW -> metrics -> checkpoint.

The loss of a step is the mean over every token of the global batch, whatever
the layout: each microbatch's summed token loss is divided by the global
token count before backward, and gradients are summed across data-parallel
ranks. That makes a dp=k run follow the dp=1 run (DESIGN: layout invariance).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections import deque
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from kernels import resolve_kernels
from megazero.checkpoint import store as checkpoint
from megazero.checkpoint.writer import CheckpointWriter
from megazero.train import lr_schedule as optim
from megazero.config.schema import Config, ModelConfig
from megazero.data import GPTData, build_data
from megazero.checkpoint.layout import complete_replicas, logical
from megazero.errors import NonFiniteStop, Preempted, UserError
from megazero.interop.hf_layout import model_config
from megazero.train.nonfinite import NonFiniteGuard
from megazero.train.signals import StopSignals, exit_code, signal_name
from megazero.engine.step import train_step
from megazero.train.run_dir import Start, clear_earlier_run, plan_start
from megazero.train.metrics import MetricsLogger, memory_gb, model_flops_per_token, peak_tflops
from models.gpt import InitialValues, build_gpt, initial_tp_value
from models.llama import kv_replicas_needed
from parallel.loss_scale import LossScaler
from parallel.host import host_values
from parallel.pipeline import PipelineExecutor, partition_layers
from parallel.schedules import build_schedule, virtual_stage
from parallel.topology import Grid, coords_to_rank
from parallel.zero import DTYPES, ZeroOptimizer

HISTORY = 100  # step records fit() keeps and returns, the last ones (metrics.jsonl holds every logged step)


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
            data = build_data(cfg.data, m.vocab_size, m.seq_len, t.seed, is_builder=True, barrier=noop,
                              train_samples=t.steps * t.global_batch)
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


_ROPE_SCALING_KEYS = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_positions")


def initial_values(cfg: Config) -> int | InitialValues:
    """Where the weights start: the seed of megazero's initialisation, or the Hugging Face model folder of
    ``train.init_from`` (its config checked against ``model``; each tensor read when its parameter is made)."""
    if not cfg.train.init_from:
        return cfg.train.seed
    from megazero.interop.hf_import import open_hf_model

    weights = open_hf_model(cfg.train.init_from, cfg.model)
    return lambda name, shape: weights.value(name)


class Trainer:
    """One rank's share of a run: its stage of the model, its data share, its optimizer."""

    def __init__(self, cfg: Config, grid: Grid, device: torch.device, is_builder: bool = True,
                 stop: Optional[StopSignals] = None, data: Optional[GPTData] = None):
        """stop: the signals that end the run at a step boundary, after a save (None: not watched). data: the
        batches (None: build them from cfg.data; ``--simulate`` passes token ids of the right shape)."""
        self.cfg, self.grid, self.device, self.stop = cfg, grid, device, stop
        resolve_kernels(cfg.kernels, device.type, cfg.model.head_dim)
        self.data = load_data_everywhere(cfg, grid, is_builder) if data is None else data
        torch.manual_seed(cfg.train.seed)
        par = cfg.parallel
        v = par.virtual_stages
        ranges = partition_layers(cfg.model.layers, grid.pp * v, par.pp_layers)
        last_vs = grid.pp * v - 1
        self.chunks = []
        lazy = cfg.zero.stage == 3  # ZeRO-3 creates the parameters itself, one bucket at a time
        values = initial_values(cfg)
        # the tp ranks that share a k/v head when there are fewer than tp (a collective: every rank builds it)
        kv_replicas = grid.tp_replica_comm(kv_replicas_needed(cfg.model, grid.tp))
        for c in range(v):  # model chunk c of this rank is virtual stage c*pp + pp_rank
            vs = virtual_stage(grid.pp_rank, c, grid.pp)
            self.chunks.append(build_gpt(cfg.model, values, device=device, tp=grid.tp_comm,
                                         layer_ids=ranges[vs], first_stage=vs == 0, last_stage=vs == last_vs,
                                         sequence_parallel=par.sequence_parallel,
                                         attention_impl=cfg.kernels.attention, materialise=not lazy,
                                         kv_replicas=kv_replicas, tp_overlap=par.tp_overlap))
        origin = {p: (m, n) for m in self.chunks for n, p in m.named_parameters()}
        self.named_params = [(n, p) for m in self.chunks for n, p in m.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        # the tied embedding: held by the first and the last virtual stage; the last one's is a copy
        for m in self.chunks:
            if m.shares_embedding_across_stages and m.last_stage:
                m.embed.tokens.weight.tied_copy = True
        seq = cfg.model.seq_len // (grid.tp if self.chunks[0].sequence_parallel else 1)
        z = cfg.zero
        self.zero = ZeroOptimizer(self.chunks, grid, z.stage, cfg.train.precision, cfg.train.lr,
                                  cfg.train.weight_decay, z.bucket_mb, z.reshard_after_forward,
                                  z.offload_optimizer, z.offload_params, adam_impl=cfg.kernels.adam, device=device,
                                  initial_value=lambda p: initial_tp_value(*origin[p], values),
                                  grad_dtype=z.grad_dtype)
        # ZeRO-3 may have given the modules new Parameter objects (fake tensors cannot be swapped in place)
        self.named_params = [(n, p) for m in self.chunks for n, p in m.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        self.executor = PipelineExecutor(self.chunks, grid, (cfg.train.micro_batch, seq, cfg.model.hidden),
                                         DTYPES[cfg.train.precision], device,
                                         cfg.train.global_batch * cfg.model.seq_len, self._autocast,
                                         overlap_p2p=par.overlap_p2p)
        self.schedule = build_schedule(par.schedule, grid.pp, cfg.microbatches, v,
                                       overlap_p2p=par.overlap_p2p)[grid.pp_rank]
        self.eval_schedule = build_schedule(par.schedule, grid.pp, cfg.microbatches, v,
                                            forward_only=True)[grid.pp_rank]
        self.step = 0
        self.consumed_samples = 0
        self.scaler = LossScaler(enabled=cfg.train.precision == "fp16")
        self.guard = NonFiniteGuard(cfg.train.on_nonfinite, cfg.train.max_skipped, fp16=self.scaler.enabled)
        self.stop_agreed = 0  # the stop signal some rank received (agreed at the last step), 0 for none
        writer_rank = coords_to_rank(grid.pp - 1, 0, 0, grid.tp, grid.dp)
        self.is_writer = grid.rank == writer_rank
        self.ckpt_root = Path(cfg.log.dir) / "checkpoints"
        self.tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
        self.flops_per_step = model_flops_per_token(cfg.model) * self.tokens_per_step
        self.peak = None  # measured lazily, only where it is reported

    # ----- one step -------------------------------------------------------------------------
    def _autocast(self):
        if self.cfg.train.precision in ("bf16", "fp16"):
            return torch.autocast(device_type=self.device.type, dtype=DTYPES[self.cfg.train.precision])
        return contextlib.nullcontext()

    def _seed(self) -> None:
        """Dropout streams of this step: one shared by the tp group, one per tp rank (per model chunk)."""
        g, seed = self.grid, self.cfg.train.seed
        torch.manual_seed(step_seed(seed, self.step, g.pp_rank, g.dp_rank))
        for c, m in enumerate(self.chunks):
            m.rng.seed(step_seed(seed, self.step, g.pp_rank, g.dp_rank, g.tp_rank, c))

    def train_step(self) -> dict:
        cfg, grid = self.cfg, self.grid
        self._seed()
        # the schedule follows the updates made: a step skipped for an fp16 overflow does not advance it (as in
        # Megatron-LM and DeepSpeed), so early overflows do not eat the warmup
        lr = optim.lr_at(self.zero.step_count, cfg.train.lr, cfg.train.min_lr, cfg.train.warmup_steps,
                         cfg.train.steps)
        for m in self.chunks:
            m.train()
        microbatches = self.data.train_microbatches(self.consumed_samples, grid.dp_rank, grid.dp,
                                                    cfg.train.micro_batch, cfg.train.global_batch)
        assert len(microbatches) == cfg.microbatches
        # a stop requested here: agreed over every rank in the step's own all-reduce
        flags = torch.tensor([float(self.stop.received or 0) if self.stop is not None else 0.0],
                             device=self.device)  # the signal's number: the agreed one is the largest received
        result = train_step(self.zero, self.executor, self.schedule, microbatches, lr, cfg.train.grad_clip,
                            self.scaler, flags=flags)
        self.train_trace = (self.executor.trace, self.executor.trace_origin)  # the last training run's timeline
        loss_sum, norm, skipped = result.loss_total, result.grad_norm, result.skipped
        self.stop_agreed = int(host_values(flags)[0])
        self.step += 1
        self.consumed_samples += cfg.train.global_batch
        loss = host_values(loss_sum / self.tokens_per_step)[0] if grid.is_last_stage else float("nan")
        record = {"loss": loss, "lr": lr, "grad_norm": norm}
        scaler = self.scaler
        if scaler.enabled:
            record["loss_scale"] = scaler.scale
        if scaler.enabled or skipped:
            record["skipped"] = int(skipped)
        self.guard.check(self.step, skipped, result.loss_nonfinite, norm, result.nonfinite_param,
                         scale_at_min=scaler.enabled and scaler.scale <= scaler.min_scale)
        return record

    @torch.no_grad()
    def evaluate(self) -> dict:
        cfg, grid = self.cfg, self.grid
        for m in self.chunks:
            m.eval()
        # one source: its validation batches; several: each source's own, eval_batches of them each
        names = self.data.source_names  # a source too small to hold validation samples is only trained on
        sources = [None] if len(names) == 1 else [k for k in range(len(names)) if self.data.samples.val_sizes[k]]
        totals = torch.zeros(len(sources), device=self.device)
        self.zero.gather_root()
        for i, source in enumerate(sources):
            for b in range(cfg.train.eval_batches):
                microbatches = self.data.val_microbatches(b, grid.dp_rank, grid.dp, cfg.train.micro_batch,
                                                          cfg.train.global_batch, source)
                totals[i] += self.executor.run(self.eval_schedule, microbatches, forward_only=True)
        self.zero.release()
        grid.dp_comm.all_reduce(totals, tag="loss")
        if not grid.is_last_stage:
            return {}
        tokens = self.tokens_per_step * cfg.train.eval_batches  # per source
        per_source = [v / tokens for v in host_values(totals)]
        val = sum(v * tokens for v in per_source) / (tokens * len(sources))  # token-weighted mean over sources
        record = {"val_loss": val, "val_ppl": math.exp(min(val, 50.0))}
        if len(sources) > 1:
            record.update({f"val_loss/{names[k]}": v for k, v in zip(sources, per_source)})
        return record

    def write_pipeline_trace(self) -> None:
        """Every rank's timeline of the last step in one Chrome-trace/Perfetto file (pid = rank)."""
        events = self.executor.chrome_trace(self.grid.rank, *self.train_trace)
        if dist.is_initialized():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, events)
            events = [e for rank_events in gathered for e in rank_events]
        if self.grid.rank == 0:
            path = Path(self.cfg.log.dir) / "pipeline_trace.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            names = [{"name": "process_name", "ph": "M", "pid": r,
                      "args": {"name": f"rank {r} (pp {r // (self.grid.dp * self.grid.tp)})"}}
                     for r in range(self.grid.world_size)]
            path.write_text(json.dumps({"traceEvents": names + events, "displayTimeUnit": "ms"}))

    def _memory_record(self) -> dict:
        """Peak memory and model-state bytes, each the largest over all ranks (the one that runs out first:
        pipeline stages and tp/dp shards differ), at a log step."""
        state = self.zero.model_state_bytes()
        kinds = ("params", "grads", "optimizer", "cpu")
        worst = torch.tensor([memory_gb(self.device)] + [state[k] / 1e9 for k in kinds], dtype=torch.float64,
                             device=self.device)
        self.zero.world.all_reduce(worst, op=dist.ReduceOp.MAX, tag="metrics")
        values = worst.tolist()
        return {"memory_gb": values[0], **{f"{'offloaded' if k == 'cpu' else k}_gb": v
                                           for k, v in zip(kinds, values[1:])}}

    # ----- checkpoints ------------------------------------------------------------------------
    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Everything a resume needs that is a tensor, under logical names (layout-free), and the
        per-parameter views it was made from (for loading back into the ZeRO buffers)."""
        params = dict(self.named_params)
        exported = self.zero.export_state()
        state = {}
        for n, kinds in exported.items():
            p = params[n]
            state[f"model/{n}"] = logical(kinds["param"], p, self.grid)
            for k in ("master", "exp_avg", "exp_avg_sq"):
                state[f"optim/{n}/{k}"] = logical(kinds[k], p, self.grid)
        return state, exported

    def save(self, writer: CheckpointWriter) -> Path:
        """Checkpoint this step (in the background with train.async_save). A state holding a non-finite value is
        never saved: keep_last would rotate the last good checkpoint away."""
        meta = {"consumed_samples": self.consumed_samples, "optimizer_step": self.zero.step_count,
                "tokenizer": str(Path(self.data.tokenizer_path).resolve()) if hasattr(self.data, "tokenizer_path")
                else None,
                "loss_scaler": self.scaler.state(),
                "config": self.cfg.to_dict(),
                "rng": "dropout streams are derived from (train.seed, step, grid coordinates)"}
        state, _ = self.state_tensors()
        bad = torch.zeros((), device=self.device)
        for t in state.values():
            local = t.to_local() if hasattr(t, "to_local") else t
            bad = torch.maximum(bad, torch.isfinite(local).logical_not().any().float().to(bad.device))
        self.zero.world.all_reduce(bad, op=dist.ReduceOp.MAX, tag="checkpoint")
        if bad.item():
            raise NonFiniteStop(f"step {self.step}: the model state holds non-finite values; not saved, so the "
                                f"latest checkpoint is the last good one")
        return writer.save(self.step, state, meta, self.run_id)

    def load(self, path: Path) -> None:
        stored = checkpoint.read_meta(path).get("config", {}).get("model", {})
        # compared as resolved values: a key an older checkpoint lacks has its old meaning (arch gpt2, a tied
        # head, every head a k/v head, norm eps 1e-5), and kv_heads unset equals kv_heads = heads
        theirs = model_config(stored)
        for key in ModelConfig.ARCHITECTURE:
            ours, there = getattr(self.cfg.model, key), getattr(theirs, key)
            if key == "kv_heads":
                ours, there = self.cfg.model.kv_head_count, theirs.kv_head_count
            if key.startswith("rope_") and self.cfg.model.arch == theirs.arch == "gpt2":
                continue  # GPT-2 has no rotary positions
            if key in _ROPE_SCALING_KEYS and self.cfg.model.rope_scaling == theirs.rope_scaling == "none":
                continue  # unscaled on both sides: the scaling's parameters are unused
            if there != ours:
                raise UserError(f"checkpoint {path}: model.{key} is {there!r} there and {ours!r} here; a resume "
                                f"keeps the architecture ({', '.join(ModelConfig.ARCHITECTURE)})")
        state, exported = self.state_tensors()
        meta = checkpoint.load(path, state)
        complete_replicas(exported, dict(self.named_params), self.grid)
        self.zero.import_state(exported, int(meta["optimizer_step"]))
        if "loss_scaler" in meta:
            self.scaler.load(meta["loss_scaler"])
        self.step = int(meta["step"])
        self.consumed_samples = int(meta["consumed_samples"])

    # ----- the loop ---------------------------------------------------------------------------
    def fit(self, start: Optional[Start] = None) -> list[dict]:
        """Train to train.steps (or train.exit_after more steps, or a stop signal), saving on the cadence.

        Returns the records of the last steps (at most HISTORY of them: a long run's memory stays flat)."""
        cfg = self.cfg
        start = plan_start(cfg) if start is None else start
        self.run_id = start.run_id
        if dist.is_initialized():  # each rank drew one: rank 0's (the one that commits) is the run's
            ids = [self.run_id]
            dist.broadcast_object_list(ids, src=0)
            self.run_id = ids[0]
        if start.resume is not None:
            self.load(start.resume)
        if self.is_writer:
            for note in start.notes:
                print(note, flush=True)
            if start.resume is not None:
                print(f"resumed from {start.resume} at step {self.step}", flush=True)
        if start.resume is None and cfg.log.overwrite and self.grid.rank == 0:
            clear_earlier_run(cfg)
        if self.step >= cfg.train.steps:
            if self.is_writer:
                print(f"the run in {cfg.log.dir} is finished (step {self.step} of train.steps={cfg.train.steps}); "
                      f"raise train.steps to continue it, or start over with log.overwrite=true or another "
                      f"log.dir", flush=True)
            return []
        logger = MetricsLogger(cfg.log.dir, cfg.train.steps, self.is_writer, cfg.log.tensorboard,
                               append=start.resume is not None, start_step=self.step)
        if self.is_writer:
            print(f"{self.grid}\nlogs: {Path(cfg.log.dir).resolve()}  "
                  f"(tensorboard --logdir {cfg.log.dir})", flush=True)
            self.peak = peak_tflops(self.device, cfg.train.precision, cfg.log.peak_tflops)
        history: deque = deque(maxlen=HISTORY)
        stop_at = cfg.train.steps
        if cfg.train.exit_after:
            stop_at = min(stop_at, self.step + cfg.train.exit_after)
        writer = CheckpointWriter(self.ckpt_root, cfg.train.keep_last, cfg.train.async_save,
                                             self.grid.timeout)
        traced = False
        try:
            window_time, window_steps = 0.0, 0
            while self.step < stop_at:
                t0 = time.perf_counter()
                record = self.train_step()  # .item() on the loss waits for the device: the time is real
                window_time += time.perf_counter() - t0
                window_steps += 1
                traced = True
                writer.poll()
                step = self.step
                if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == cfg.train.steps):
                    record.update(self.evaluate())
                if step % cfg.log.every == 0 or step == cfg.train.steps or self.stop_agreed:
                    dt = window_time / window_steps
                    tflops = self.flops_per_step / dt / self.grid.world_size / 1e12
                    record.update({"tokens_per_s": self.tokens_per_step / dt, "tflops": tflops,
                                   "mfu": tflops / self.peak if self.peak else float("nan")})
                    record.update(self._memory_record())
                    logger.log(step, record)
                    window_time, window_steps = 0.0, 0
                history.append({"step": step, **record})
                if (cfg.train.save_every and step % cfg.train.save_every == 0) or step == stop_at \
                        or self.stop_agreed:
                    saved = self.save(writer)
                if self.stop_agreed and self.step < stop_at:
                    writer.wait()
                    signum = self.stop_agreed
                    raise Preempted(f"step {self.step}: {signal_name(signum)} received; saved {saved} "
                                    f"(train.resume=auto continues from it)", exit_code(signum))
            writer.wait()
        except (NonFiniteStop, Preempted):  # agreed by every rank: a write in flight is of a good state, finish it
            writer.close()
            raise
        except BaseException:  # its peers may be gone (a timeout, a lost rank): do not wait for a write in flight
            writer.close(abandon=True)
            raise
        else:
            writer.close()
        finally:
            logger.close()
        if cfg.log.pipeline_trace and traced:
            self.write_pipeline_trace()
        if self.is_writer:
            print(f"done: {self.step} steps; metrics in {Path(cfg.log.dir) / 'metrics.jsonl'}, "
                  f"checkpoints in {self.ckpt_root}", flush=True)
        return list(history)
