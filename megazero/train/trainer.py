"""The training loop: steps, their bookkeeping (lr, stop signals, non-finite checks), logging and saving.

The loss of a step is the mean over every token of the global batch, whatever
the layout: each microbatch's summed token loss is divided by the global
token count before backward, and gradients are summed across data-parallel
ranks. That makes a dp=k run follow the dp=1 run (DESIGN: layout invariance).
The engine it drives is ``megazero.engine.build``'s; evaluation, checkpoint state, the pipeline trace, the
memory record, loss spikes and stragglers are their own modules beside this one.
"""
from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megazero.checkpoint.writer import CheckpointWriter
from megazero.config.schema import Config
from megazero.costs import attention_flops_per_token, model_flops_per_token
from megazero.data import GPTData
from megazero.engine.build import build_engine
from megazero.engine.routers import router_record
from megazero.engine.step import train_step
from megazero.errors import LossSpikeStop, NonFiniteStop, Preempted
from megazero.train.layout_change import layout_change
from megazero.train.loss_spikes import Spike, SpikeWatch
from megazero.train.lr_schedule import lr_at
from megazero.train.checkpoint_state import load_state, save_state
from megazero.engine.compile_blocks import compiled_graphs
from megazero.train.evaluation import evaluate
from megazero.train.memory_record import memory_record
from megazero.train.metrics import MetricsLogger, peak_tflops
from megazero.train.nonfinite import NonFiniteGuard
from megazero.train.pipeline_trace import write_pipeline_trace
from megazero.train.rank_data import load_data_everywhere, seed_step
from megazero.train.run_dir import Start, clear_earlier_run
from megazero.train.run_lock import writer_rank
from megazero.train.signals import StopSignals, exit_code, signal_name
from megazero.train.stragglers import StragglerWatch
from megazero.train.wandb_log import WandbRun
from megazero.parallel.host import host_values
from megazero.parallel.sequence import document_mask_share
from megazero.parallel.topology import Grid

HISTORY = 100  # step records fit() keeps and returns, the last ones (metrics.jsonl holds every logged step)


def _host_loss(loss) -> float:
    """A step's loss as a number: read from the device once it is wanted (a float already off the last stage)."""
    return loss if isinstance(loss, float) else host_values(loss)[0]


class Trainer:
    """One rank's share of a run: its engine (``megazero.engine.build``), its data share, the loop's state."""

    def __init__(self, cfg: Config, grid: Grid, device: torch.device, is_builder: bool = True,
                 stop: Optional[StopSignals] = None, data: Optional[GPTData] = None):
        """cfg: resolved (world, kernels). stop: the signals that end the run at a step boundary, after a save
        (None: not watched). data: the batches (None: build them from cfg.data; ``--simulate`` passes token
        ids of the right shape)."""
        self.cfg, self.grid, self.device, self.stop = cfg, grid, device, stop
        self.data = load_data_everywhere(cfg, grid, is_builder) if data is None else data
        self.engine = build_engine(cfg, grid, device, eos_id=self.data.eos_id)
        e = self.engine
        self.chunks, self.zero, self.executor, self.scaler = e.chunks, e.zero, e.executor, e.scaler
        self.schedule, self.eval_schedule, self.named_params = e.schedule, e.eval_schedule, e.named_params
        self.tokens_per_step = e.tokens_per_step
        self.step = 0
        self.consumed_samples = 0
        self.guard = NonFiniteGuard(cfg.train.on_nonfinite, cfg.train.max_skipped, fp16=self.scaler.enabled)
        t = cfg.train
        self.spikes = SpikeWatch(t.on_spike, t.spike_window, t.spike_z, t.max_rollbacks)
        self.spike_loss: Optional[float] = None  # the last step's loss as every rank agreed it (train.on_spike)
        self.stragglers = StragglerWatch(self.zero.world, t.straggler_ratio, t.straggler_logs, device)
        self.compute_s, self.compute_steps = 0.0, 0  # this rank's compute time since the last log
        self.stop_agreed = 0  # the stop signal some rank received (agreed at the last step), 0 for none
        self.is_writer = grid.rank == writer_rank(grid)
        self.ckpt_root = Path(cfg.log.dir) / "checkpoints"
        self.flops_per_step = model_flops_per_token(cfg.model) * self.tokens_per_step  # causal attention
        # document masking: the kernels skip the masked blocks, so a step's attention FLOPs are those of the mask
        masked = cfg.data.document_mask and self.data.eos_id >= 0
        self.document_eos = self.data.eos_id if masked else None
        self.attention_flops = attention_flops_per_token(cfg.model) * self.tokens_per_step
        self.step_flops = self.flops_per_step  # the last step's, as the metrics count it
        self.peak = None  # measured lazily, only where it is reported
        self.routers = None

    # ----- one step -------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One optimizer step on the next global batch; returns its record (loss, lr, grad_norm, ...)."""
        cfg, grid = self.cfg, self.grid
        seed_step(cfg.train.seed, self.step, grid, self.chunks)
        grid.counter.ops.step = self.step + 1  # named in a hang's record (megazero.hang)
        # compute time (the step less its waits): every step on the CPU, where the host clock is free; on CUDA
        # the steps that will be logged, whose events are read where the loss is
        logs = (self.step + 1) % cfg.log.every == 0 or self.step + 1 == cfg.train.steps
        grid.counter.clock.begin(self.device, on=self.device.type != "cuda" or logs)
        # the schedule follows the updates made: a step skipped for an fp16 overflow does not advance it (as in
        # Megatron-LM and DeepSpeed), so early overflows do not eat the warmup
        lr = lr_at(self.zero.step_count, cfg.train.lr, cfg.train.min_lr, cfg.train.warmup_steps, cfg.train.steps)
        for m in self.chunks:
            m.train()
        microbatches = self.data.train_microbatches(self.consumed_samples, grid.dp_rank, grid.dp,
                                                    cfg.train.micro_batch, cfg.train.global_batch)
        assert len(microbatches) == cfg.microbatches
        self.step_flops = self.counted_flops(microbatches)
        # a stop requested here: agreed over every rank in the step's own all-reduce
        flags = torch.tensor([float(self.stop.received or 0) if self.stop is not None else 0.0],
                             device=self.device)  # the signal's number: the agreed one is the largest received
        result = train_step(self.zero, self.executor, self.schedule, microbatches, lr, cfg.train.grad_clip,
                            self.scaler, flags=flags, agree_loss=self.spikes.active)
        self.train_trace = (self.executor.trace, self.executor.trace_origin)  # the last training run's timeline
        compute = grid.counter.clock.end()
        if compute is not None:
            self.compute_s, self.compute_steps = self.compute_s + compute, self.compute_steps + 1
        self.routers = result.routers  # the last step's mixture-of-experts figures (None: a dense model)
        loss_sum, norm, skipped = result.loss_total, result.grad_norm, result.skipped
        self.stop_agreed = int(result.flags[0])
        agreed = result.loss_agreed is not None and not skipped
        self.spike_loss = result.loss_agreed / self.tokens_per_step if agreed else None
        self.step += 1
        self.consumed_samples += cfg.train.global_batch
        # the loss stays on the device until it is logged (``_host_loss``): read now, it would make the host wait
        # for the update before it queues the next step
        loss = loss_sum / self.tokens_per_step if grid.is_last_stage else float("nan")
        record = {"loss": loss, "lr": lr, "grad_norm": norm}
        if cfg.train.compile:  # flat after the first steps; a rise is a recompilation
            record["compiled_graphs"] = compiled_graphs()
        scaler = self.scaler
        if scaler.enabled:
            record["loss_scale"] = scaler.scale
        if scaler.enabled or skipped:
            record["skipped"] = int(skipped)
        self.guard.check(self.step, skipped, result.loss_nonfinite, norm, result.nonfinite_param,
                         scale_at_min=scaler.enabled and scaler.scale <= scaler.min_scale)
        return record

    def counted_flops(self, microbatches: list[torch.Tensor]) -> float:
        """The step's FLOPs as throughput and MFU count them: the causal count, its attention part scaled by the
        share of the causal mask the document mask keeps (parallel.sequence.document_mask_share) on this rank's
        samples, the step's sample of the global batch's documents. A few host ops over the token ids."""
        if self.document_eos is None:
            return self.flops_per_step
        share = sum(document_mask_share(mb[:, :-1], self.document_eos) for mb in microbatches) / len(microbatches)
        return self.flops_per_step - self.attention_flops * (1.0 - share)

    def evaluate(self) -> dict:
        """The validation losses now (see ``megazero.train.evaluation``)."""
        return evaluate(self.engine, self.data, self.cfg, self.grid, self.device)

    # ----- checkpoints ------------------------------------------------------------------------
    def save(self, writer: CheckpointWriter) -> Path:
        """Checkpoint this step; a non-finite state is refused (``megazero.train.checkpoint_state``)."""
        return save_state(writer, self.cfg, self.zero, self.named_params, self.grid, self.scaler, self.step,
                          self.consumed_samples, self.data, self.run_id, self.device, self.engine.named_buffers,
                          self.spikes.meta())

    def load(self, path: Path) -> list[str]:
        """Resume from a checkpoint of the same architecture, in any layout; returns the lines for the writing rank
        to print: the layout that changed since it, the data settings that did (unless
        train.resume_changes=allow)."""
        meta, changed = load_state(path, self.cfg, self.zero, self.named_params, self.grid, self.scaler, self.data,
                                   self.engine.named_buffers)
        self.step = int(meta["step"])
        self.consumed_samples = int(meta["consumed_samples"])
        self.spikes.restore(meta)
        return [line for line in (layout_change(meta.get("config", {}), self.cfg), changed) if line]

    def roll_back(self, spike: Spike, writer: CheckpointWriter, logger: MetricsLogger) -> Path:
        """train.on_spike (``megazero.train.loss_spikes``): stop, or load the newest checkpoint from before the
        spike's window, keep the sample offset past the spike (its batches and those before it since the
        checkpoint are skipped) and save that at once, so a resume skips them too; returns that save."""
        logger.log(spike.step, {"loss": spike.loss, "spike_z": spike.z})
        writer.wait()  # a save in flight is of a state from before the spike
        target = self.spikes.decide(spike, self.ckpt_root, self.run_id, self.grid.rank)
        consumed, rollbacks, skipped = self.consumed_samples, self.spikes.rollbacks, self.spikes.skipped_batches
        self.load(target)  # the state, the step and the window of losses as they were then
        self.consumed_samples = consumed
        self.spikes.rollbacks, self.spikes.skipped_batches = rollbacks, skipped
        self.guard.skipped_in_a_row = 0  # as a resume from that checkpoint would start
        line = self.spikes.rolled_back(spike, self.step)
        if self.is_writer:
            print(f"warning: {line}", flush=True)
        logger.log(spike.step, {"rolled_back_to": self.step, "skipped_batches": self.spikes.skipped_batches,
                                "rollbacks": self.spikes.rollbacks})
        return self.save(writer)

    def _stop(self, writer: CheckpointWriter, saved: Path) -> None:
        """The stop signal every rank agreed on, after its save: the run exits 128 + the signal."""
        writer.wait()
        raise Preempted(f"step {self.step}: {signal_name(self.stop_agreed)} received; saved {saved} "
                        f"(train.resume=auto continues from it)", exit_code(self.stop_agreed))

    # ----- the loop ---------------------------------------------------------------------------
    def fit(self, start: Start) -> list[dict]:
        """Train to train.steps (or train.exit_after more steps, or a stop signal), saving on the cadence.

        Returns the records of the last steps (at most HISTORY of them: a long run's memory stays flat)."""
        cfg = self.cfg
        self.run_id = start.run_id
        if dist.is_initialized():  # each rank drew one: rank 0's (the one that commits) is the run's
            ids = [self.run_id]
            dist.broadcast_object_list(ids, src=0)
            self.run_id = ids[0]
        notes = list(start.notes)
        if start.resume is not None:
            notes += self.load(start.resume)
        if self.stop is not None:  # from here on log.dir changes: a stop signal waits for a step and its save
            self.stop.defer()
        if self.is_writer:
            for note in notes:
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
        resumed = start.resume is not None
        wandb = (lambda: WandbRun(cfg, resumed)) if cfg.log.wandb.project else None
        logger = MetricsLogger(cfg.log.dir, cfg.train.steps, self.is_writer, cfg.log.tensorboard,
                               append=resumed, start_step=self.step, wandb=wandb)
        if self.is_writer:
            print(f"{self.grid}\nlogs: {Path(cfg.log.dir).resolve()}  "
                  f"(tensorboard --logdir {cfg.log.dir})", flush=True)
            self.peak = peak_tflops(self.device, cfg.train.precision, cfg.log.peak_tflops)
        history: deque = deque(maxlen=HISTORY)
        stop_at = cfg.train.steps
        if cfg.train.exit_after:
            stop_at = min(stop_at, self.step + cfg.train.exit_after)
        writer = CheckpointWriter(self.ckpt_root, cfg.train.keep_last, cfg.train.async_save, self.grid.timeout)
        traced = False
        try:
            window_time, window_steps, window_flops = 0.0, 0, 0.0
            while self.step < stop_at:
                t0 = time.perf_counter()
                record = self.train_step()
                spike = self.spikes.check(self.step, self.spike_loss) if self.spike_loss is not None else None
                if spike is not None:  # never saved: the spike's update is in the state
                    saved = self.roll_back(spike, writer, logger)
                    window_time, window_steps, window_flops = 0.0, 0, 0.0
                    if self.stop_agreed:  # a stop signal in the same step: the rolled-back save is the one
                        self._stop(writer, saved)
                    continue
                logged = self.step % cfg.log.every == 0 or self.step == cfg.train.steps or self.stop_agreed
                if logged:  # the loss read waits for the device: the window's time is then real
                    record["loss"] = _host_loss(record["loss"])
                window_time += time.perf_counter() - t0
                window_steps += 1
                window_flops += self.step_flops
                traced = True
                writer.poll()
                step = self.step
                if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == cfg.train.steps):
                    record.update(self.evaluate())
                if logged:
                    dt = window_time / window_steps
                    tflops = window_flops / window_time / self.grid.world_size / 1e12
                    record.update({"tokens_per_s": self.tokens_per_step / dt, "tflops": tflops,
                                   "mfu": tflops / self.peak if self.peak else float("nan")})
                    record.update(memory_record(self.zero, self.device))
                    record.update(router_record(self.routers))
                    record.update(self.zero.optimizer_record())
                    figures, warning = self.stragglers.observe(self.compute_s / max(self.compute_steps, 1))
                    record.update(figures)
                    self.compute_s, self.compute_steps = 0.0, 0
                    if warning and self.is_writer:
                        print(warning, flush=True)
                    logger.log(step, record)
                    window_time, window_steps, window_flops = 0.0, 0, 0.0
                history.append({"step": step, **record})
                # a job of train.exit_after saves where it ends, train.steps too: the next job sees it finished
                at_end = step == stop_at and (cfg.train.save_at_end or cfg.train.exit_after > 0)
                if (cfg.train.save_every and step % cfg.train.save_every == 0) or at_end or self.stop_agreed:
                    saved = self.save(writer)
                if self.stop_agreed and self.step < stop_at:
                    self._stop(writer, saved)
            writer.wait()
        except (NonFiniteStop, LossSpikeStop, Preempted):  # agreed by every rank: a write in flight is good
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
            write_pipeline_trace(self.executor, self.grid, cfg.log.dir, *self.train_trace)
        if self.is_writer:
            print(f"done: {self.step} steps; metrics in {Path(cfg.log.dir) / 'metrics.jsonl'}, "
                  f"checkpoints in {self.ckpt_root}", flush=True)
        pending = [r["loss"] for r in history if not isinstance(r["loss"], float)]  # the steps not logged
        read = iter(host_values(torch.stack(pending)) if pending else [])  # in one read
        return [{**r, "loss": r["loss"] if isinstance(r["loss"], float) else next(read)} for r in history]
