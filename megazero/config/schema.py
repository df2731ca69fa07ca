"""The config's schema: one dataclass per YAML section, with defaults and what each key means.

The model section (``ModelConfig``, ``MoeConfig``) is declared in models/config.py, beside the models that
read it. Values are typed and checked by megazero.config.load, ranged by megazero.config.rules and the derived
ones fixed by megazero.config.resolve; the schema itself only declares.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Union

from megazero.models.config import AUTO, ModelConfig, MoeConfig  # noqa: F401 (the model section lives with the models)
from megazero.parallel.zero.registry import OPTIMIZERS


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallelism (Megatron): each layer's matrices split over tp ranks
    pp: int = 1  # pipeline parallelism: the layers split into pp stages
    dp: Union[int, str] = AUTO  # "auto" = world_size / (tp * pp * cp), resolved at launch
    ep: int = 1  # expert parallelism: model.moe's experts split over ep ranks carved out of dp (docs/moe.md)
    cp: int = 1  # context parallelism: each sample's sequence split over cp ranks (docs/context.md)
    cp_mode: str = "ring"  # ring: K/V passed around the cp ranks | all_to_all: Ulysses, heads split around attention
    # with tp > 1: norms and dropout on 1/tp of the sequence (Korthikanti et al. 2022); seq_len divisible by tp
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zb1p
    # model chunks per pipeline rank (interleaved, >= 2; microbatches per rank a multiple of pp)
    virtual_stages: int = 1
    # layers per (virtual) stage: a list of counts; [] = even (earlier stages take the remainder); auto = balanced
    # by cost (parallel.balance: the last stage's head and loss, the first's embedding), resolved to a list
    pp_layers: Union[list, str] = field(default_factory=list)
    # p2p posted ahead of the compute before its use and waited at first use (Megatron's overlap_p2p_comm)
    overlap_p2p: bool = True
    # Domino-style overlap (Wang et al. 2024): each layer's microbatch in two halves, one half's tp collective
    # in flight under the other half's matmuls
    tp_overlap: bool = False
    world_size: int = 0  # 0 = the launcher's; set it to plan a run of another size with --dry-run


@dataclass
class ZeroConfig:
    stage: int = 0  # 0 | 1 | 2 | 3 (Rajbhandari et al. 2020)
    bucket_mb: float = 25.0  # gradient/parameter communication bucket size
    # stage 3: free a gathered layer after its forward (false: keep it for the step); auto = true without a
    # pipeline, false with one (each layer would be gathered 2m times per step), fixed by resolve
    reshard_after_forward: Union[bool, str] = AUTO
    # none | cpu | nvme: fp32 master weights and Adam states in CPU memory (cpu), or in a scratch file on a local
    # disk under zero.nvme_path, streamed through zero.nvme_buffer_mb of host buffers each step (nvme, ZeRO-Infinity)
    offload_optimizer: str = "none"
    nvme_path: str = ""  # zero.offload_optimizer=nvme: the folder the scratch files go in (a folder per rank under it)
    nvme_buffer_mb: float = 64.0  # zero.offload_optimizer=nvme: host memory that streams the states, per partition
    # none | cpu | nvme (stage 3): parameter shards in CPU memory, or in a scratch file under zero.nvme_path, each
    # layer's read ahead of its gather (nvme: with zero.offload_optimizer=nvme, whose stream updates them)
    offload_params: str = "none"
    # the dtype gradients are accumulated over microbatches and reduced over dp in: auto = fp32 under bf16
    # (as Megatron-LM: bf16 sums of many microbatches lose bits), else the model's
    grad_dtype: str = "auto"  # auto | fp32 | model


@dataclass
class TrainConfig:
    steps: int = 100  # optimizer steps of the whole run
    global_batch: int = 8  # sequences per step, over all dp ranks and microbatches
    micro_batch: int = 8  # sequences per forward pass on one rank; global_batch / (micro_batch * dp) microbatches
    lr: float = 6e-4  # the peak learning rate, after the linear warm-up; cosine decay to min_lr by the last step
    min_lr: float = 6e-5  # the learning rate at the last step
    warmup_steps: int = 10  # steps of linear warm-up from 0 to lr
    weight_decay: float = 0.1  # decoupled (AdamW's), on matrices only: norms and biases do not decay
    grad_clip: float = 1.0  # the global gradient norm is clipped to this; 0 disables clipping
    # > 0: the head's matmul and the loss this many tokens at a time, so only one chunk's logits exist, not the
    # microbatch's (one more head matmul in backward: parallel/head_loss.py); 0: the microbatch's at once
    loss_chunk_tokens: int = 0
    # each transformer block compiled by torch.compile (megazero/engine/compile_blocks.py; inductor's cache under
    # .cache/): the first steps compile, the rest run the compiled code. Not with zb1p or mixtures of experts
    compile: bool = False
    # none | tensorwise | rowwise: the GEMMs of the blocks' linears (all but the first and last block's) in FP8
    # with dynamic scaling, one scale per tensor or per row (kernels/fp8.py); a GPU needs sm_89 or later
    fp8: str = "none"
    # fp32 | bf16 | fp16 | auto: bf16 where the device computes it natively (a GPU with bf16, a CPU with AMX),
    # else fp32 (megazero.config.resolve.precision_for; the run's first line says which and why)
    precision: str = "fp32"
    seed: int = 1234  # the initial weights (layout-free: the same at any tp, pp, dp) and the data order
    eval_every: int = 0  # 0 disables evaluation
    eval_batches: int = 1  # global batches of validation data per evaluation
    save_every: int = 0  # 0: save only at the end
    # false: no checkpoint when the run reaches train.steps (benchmarks, throwaway runs); save_every, a stop
    # signal and each job of train.exit_after still save; not with train.resume=auto alone
    save_at_end: bool = True
    keep_last: int = 2  # checkpoints kept; older ones are deleted once a newer one is complete
    resume: str = "none"  # none | auto (the latest in log.dir/checkpoints) | a checkpoint path; any layout
    exit_after: int = 0  # stop (and save) after this many steps of this job, e.g. for time-limited slots; 0 = never
    on_nonfinite: str = "stop"  # stop | skip: a non-finite loss or gradient norm stops the run, or skips the update
    max_skipped: int = 10  # consecutive skipped updates before the run stops (fp16: at the minimum loss scale)
    # none | stop | rollback: a loss spike_z standard deviations above the mean of the last spike_window losses
    # stops the run (exit 3), or rolls back to the newest checkpoint at or before step spike - spike_window and
    # skips the global batches from there through the spike (megazero/train/loss_spikes.py)
    on_spike: str = "none"
    spike_window: int = 100  # the recent losses a step's is judged against (PaLM rolled back ~100 steps)
    spike_z: float = 6.0  # standard deviations above their mean that make a spike (Gaussian noise: ~1 in 10^9)
    max_rollbacks: int = 5  # rollbacks in a run (resumes included) before a spike stops it
    # each logged step every rank's compute time (its step less its waits on communication) is compared:
    straggler_ratio: float = 1.25  # a rank this many times the median for straggler_logs logs is named
    straggler_logs: int = 3  # logs in a row above train.straggler_ratio before a rank is named in a warning
    async_save: bool = False  # write checkpoints in the background while training goes on
    init_from: str = ""  # a Hugging Face model folder (GPT-2 or Llama) the weights start from; optimizer fresh
    init_unused: str = "refuse"  # refuse | drop: tensors in init_from that the config does not use
    # warn | allow: a resume whose data.paths (the files under each), blend weights, text_key, split or train.seed
    # differ from the checkpoint's says so in one line, or not (another tokenizer is always refused)
    resume_changes: str = "warn"


@dataclass
class DataConfig:
    # .txt, .jsonl(.gz/.zst), .parquet files or folders, or preprocessed prefixes; an entry may be {path, weight,
    # name} (a weighted blend: all entries weighted or none); empty: the built-in corpus (docs/operations.md)
    paths: list = field(default_factory=list)
    text_key: str = "text"  # the field of a .jsonl/.parquet record that holds the document
    # train: a byte-fallback sentencepiece BPE of model.vocab_size trained on the data (cached) | a sentencepiece
    # .model | a Hugging Face tokenizer.json (no BOS/EOS added; documents joined by its end-of-text token)
    tokenizer: str = "train"
    # train,validation weights: each source split by whole documents (its last ones validate); "100,0": none
    split: str = "98,2"
    cache_dir: str = ".cache/megazero"  # tokenised data and trained tokenizers, reused between runs
    # inside a packed sample a token attends only to earlier tokens of its own document (the end-of-text token
    # closes a document); reset_positions restarts positions at each document (Megatron's reset_position_ids)
    document_mask: bool = False
    reset_positions: bool = False  # restart positions at each document (with document_mask, above)
    # under document_mask, the length of a token's document for the plan (--dry-run, the planner; sum l^2 / sum l
    # over varying lengths): the kernels skip what the mask removes (megazero.costs.expected_document_share);
    # 0: no estimate (causal). A run counts its own documents.
    document_tokens: int = 0


@dataclass
class WandbConfig:
    """``log.wandb``: the same scalars as TensorBoard to Weights & Biases (``pip install 'megazero[wandb]'``)."""

    project: str = ""  # the W&B project; "" = off (nothing of wandb is imported)
    name: str = ""  # the run's name; "" = the config's name
    mode: str = "offline"  # offline (files under log.dir/wandb, `wandb sync` them later) | online


@dataclass
class LogConfig:
    dir: str = ""  # "" -> runs/<config name>
    every: int = 1  # steps between log lines (and TensorBoard points)
    tensorboard: bool = True  # write TensorBoard event files to log.dir
    # per device, for MFU; auto = the GPU's data sheet, or a matmul in the run's dtype measured on a CPU (~0.3 s)
    peak_tflops: Union[float, str] = AUTO
    pipeline_trace: bool = False  # write pipeline_trace.json (Chrome trace / Perfetto) of the last step
    overwrite: bool = False  # a fresh run may replace an earlier run's checkpoints and logs in log.dir
    wandb: WandbConfig = field(default_factory=WandbConfig)  # a mapping: log.wandb.project, ... (above)


@dataclass
class KernelsConfig:
    # auto | triton | torch | blocks: auto = torch SDPA (cuDNN on Hopper: faster than the Triton kernel); under
    # data.document_mask a path with no (seq, seq) mask: blocks on the CPU, triton on a GPU
    attention: str = AUTO
    adam: str = AUTO  # auto | fused | triton | torch: the optimizer step over flat buffers
    # auto | triton | torch: the norms' forward and backward, one Triton kernel each (kernels/norm.py) or
    # torch's; auto = torch until a GPU measurement shows the kernels faster
    norm: str = AUTO


@dataclass
class _OptimName:
    # a row of parallel.zero.registry (the valid column lists them): the update each rank applies to its
    # share of ZeRO's flat buffers; its settings are optim.<name>.*, the learning rate, its schedule and the
    # weight decay train.*'s
    name: str = "adamw"
    # a resume from a checkpoint of this optimizer continues with optim.name's instead (1-bit and 0/1 Adam to adamw
    # or lamb): the masters and moments go on, the per-rank state is dropped; '' resumes the same optimizer only
    switch_from: str = ""


# ``optim``: the name, then one section per optimizer of the registry (``optim.adamw.beta1``, ...), each the
# dataclass its row declares, with its keys' comments
OptimConfig = dataclasses.make_dataclass(
    "OptimConfig", [(n, row.section, field(default_factory=row.section)) for n, row in OPTIMIZERS.items()],
    bases=(_OptimName,))


@dataclass
class LaunchConfig:
    device: str = AUTO  # auto | cpu | cuda
    timeout_minutes: float = 30.0  # a collective that waits longer than this stops the run
    memory_gb: float = 0.0  # --simulate: the memory a rank may use (0: this machine's device, or its RAM)
    rank: int = -1  # --simulate: the one rank to simulate (-1: one rank of each memory class)
    cpu_threads: int = 0  # intra-op threads per rank where the CPU computes (0: the node's cores over its ranks)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    name: str = "run"
    source: str = "<config>"  # the file it came from, for error messages

    @property
    def microbatches(self) -> int:
        """Microbatches each DP rank runs per step (gradient accumulation)."""
        assert isinstance(self.parallel.dp, int), "megazero.config.resolve.resolve() first"
        return self.train.global_batch // (self.train.micro_batch * self.parallel.dp)

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            if f.name in ("name", "source"):
                continue
            out[f.name] = dataclasses.asdict(getattr(self, f.name))
        out["name"] = self.name
        return out


SECTIONS = {
    "model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig,
    "data": DataConfig, "log": LogConfig, "launch": LaunchConfig, "zero": ZeroConfig,
    "kernels": KernelsConfig, "optim": OptimConfig,
}
