"""The rules a config must obey: ranges, choices and cross-field constraints, world size included.

Checked before any process group or allocation (``megazero.config.load.load_config``
calls :func:`validate`; the launcher calls :func:`resolve_world` once the world
size is known). Every failure is one line naming the file, the key, the value
and what would be valid (``megazero.errors.invalid``). Every numeric key has a
range (_MIN, _MAX, or a choice list) that keeps what is computed from it
downstream — torch sizes, numpy seeds, int64 counts, schedule lengths — from
overflowing or hanging. Values that have a parser of their own — the schedule
(``parallel.schedules``), ``data.split`` (``megazero.data.samples``) — are
checked by calling it, so a config passes here exactly when the run accepts it.

Imports go one way: ``megazero.config.load`` imports this module, which reads the
config it is handed and imports nothing from ``megazero.config.load``.
"""
from __future__ import annotations

from pathlib import Path

from megazero.data.samples import parse_split
from megazero.config.data_paths import entry_path
from megazero.errors import UserError, invalid
from models import arch
from parallel.balance import StageCosts, balance_layers
from parallel.schedules import SCHEDULES, schedule_constraint

from megazero.config.schema import AUTO, Config


# Allowed values and ranges, per key. A key absent here only needs the right type.
_CHOICES = {
    ("model", "arch"): ("gpt2", "llama"),
    ("model", "rope_scaling"): ("none", "llama3"),
    ("train", "precision"): ("fp32", "bf16", "fp16"),
    ("zero", "stage"): (0, 1, 2, 3),
    ("zero", "offload_optimizer"): ("none", "cpu"),
    ("zero", "offload_params"): ("none", "cpu"),
    ("zero", "grad_dtype"): ("auto", "fp32", "model"),
    ("kernels", "attention"): ("auto", "triton", "torch"),
    ("kernels", "adam"): ("auto", "fused", "triton", "torch"),
    ("launch", "device"): ("auto", "cpu", "cuda"),
    ("parallel", "schedule"): SCHEDULES,
    ("train", "on_nonfinite"): ("stop", "skip"),
}
_MIN = {
    ("model", "layers"): 1, ("model", "hidden"): 1, ("model", "heads"): 1, ("model", "seq_len"): 1,
    ("model", "vocab_size"): 2, ("model", "ffn_hidden"): 1, ("model", "vocab_pad_multiple"): 1,
    ("model", "checkpoint_layers"): 0, ("model", "kv_heads"): 1, ("model", "norm_eps"): 1e-12,
    ("model", "rope_theta"): 1.0, ("model", "rope_factor"): 1.0, ("model", "rope_low_freq_factor"): 1e-6,
    ("model", "rope_high_freq_factor"): 1e-6, ("model", "rope_original_positions"): 1,
    ("parallel", "tp"): 1, ("parallel", "pp"): 1, ("parallel", "dp"): 1, ("parallel", "virtual_stages"): 1,
    ("train", "steps"): 1, ("train", "global_batch"): 1, ("train", "micro_batch"): 1,
    ("train", "lr"): 0.0, ("train", "min_lr"): 0.0, ("train", "warmup_steps"): 0,
    ("train", "weight_decay"): 0.0, ("train", "grad_clip"): 0.0, ("train", "seed"): 0,
    ("train", "eval_every"): 0, ("train", "eval_batches"): 1, ("train", "save_every"): 0,
    ("train", "keep_last"): 1, ("train", "exit_after"): 0, ("zero", "bucket_mb"): 0.001,
    ("parallel", "world_size"): 0, ("log", "every"): 1, ("model", "init_std"): 0.0,
    ("log", "peak_tflops"): 1e-9, ("train", "max_skipped"): 1,
    ("launch", "memory_gb"): 0.0, ("launch", "rank"): -1,
    ("launch", "timeout_minutes"): 0.01,  # > 0: torch counts in milliseconds, so less would round to no wait
}

# Upper bounds, each with the reason: what downstream would overflow, hang or allocate without them.
# Shapes are bounded so that the largest tensor a rank builds, one microbatch's fp32 logits
# (micro_batch * seq_len * padded vocab = 2^16 * 2^20 * 2^24 elements), stays below int64 byte counts.
_STEPS = 2 ** 31 - 1  # step counts: int32, so any logger or tensor that keeps one holds it; 68 years at 1 s/step
_WORLD = 2 ** 20  # ranks: as megazero.launch; the dry run lists every rank of every stage
_MAX = {
    ("model", "layers"): 2 ** 31 - 1,  # the dry run builds one layer and multiplies: any count plans in seconds
    ("model", "hidden"): 2 ** 18,  # 262,144 (GPT-3 175B: 12,288): the embedding vocab*hidden < 2^43
    ("model", "heads"): 2 ** 18,  # heads divide hidden
    ("model", "seq_len"): 2 ** 20,  # a million tokens per sequence; logits bound above
    ("model", "vocab_size"): 2 ** 24,  # ids fit the int32 .bin; logits bound above; LLMs use <= 256k
    ("model", "ffn_hidden"): 2 ** 20,  # 4 * the largest hidden: the MLP weight hidden*ffn < 2^39
    ("model", "vocab_pad_multiple"): 2 ** 16,  # padding beyond 65,536 rows only wastes memory
    ("model", "checkpoint_layers"): 2 ** 31 - 1,  # as model.layers
    ("model", "init_std"): 10.0,
    ("model", "kv_heads"): 2 ** 18,  # as model.heads, which it divides
    ("model", "norm_eps"): 1.0,  # added to a mean square; past 1 it outweighs unit-scale activations
    ("model", "rope_theta"): 1e12,  # Llama 3 uses 500,000; fp32 frequencies theta^(-2i/d) stay normal
    ("model", "rope_factor"): 1e6,  # Llama 3.1: 8; a context a million times the original is past any use
    ("model", "rope_low_freq_factor"): 1e6, ("model", "rope_high_freq_factor"): 1e6,  # Llama 3.1: 1 and 4
    ("model", "rope_original_positions"): 2 ** 20,  # as model.seq_len  # GPT-2 uses 0.02; a std past 10 only overflows 16-bit activations
    ("parallel", "tp"): _WORLD, ("parallel", "pp"): _WORLD, ("parallel", "dp"): _WORLD,
    ("parallel", "world_size"): _WORLD,
    ("parallel", "virtual_stages"): 4096,  # pp * virtual_stages <= model.layers
    ("train", "steps"): _STEPS, ("train", "warmup_steps"): _STEPS, ("train", "eval_every"): _STEPS,
    ("train", "save_every"): _STEPS, ("train", "exit_after"): _STEPS, ("train", "keep_last"): _STEPS,
    ("train", "max_skipped"): _STEPS, ("log", "every"): _STEPS,
    ("train", "global_batch"): 2 ** 24,  # sequences per step: tokens per step (x seq_len) < 2^44
    ("train", "micro_batch"): 2 ** 16,  # sequences per forward; logits bound above
    # validation tokens (global_batch * seq_len * eval_batches) divide a torch tensor: < 2^60
    ("train", "eval_batches"): 2 ** 16,
    # AdamW moves each weight by about lr per step, so past ~1 nothing trains; but a learning rate that
    # diverges is train.on_nonfinite's to catch, not a config error. 1e9 keeps every update finite in fp32.
    ("train", "lr"): 1e9,
    ("train", "min_lr"): 1e9,
    ("train", "weight_decay"): 1.0,  # decoupled, w -= lr*wd*w: with lr <= 1 no step flips a weight's sign
    ("train", "grad_clip"): 1e6,  # a norm past this is divergence, not something to clip to; fp32 scalar
    ("train", "seed"): 2 ** 63 - 1,  # torch.manual_seed takes < 2^64, numpy any; int64 everywhere else
    ("zero", "bucket_mb"): 65536.0,  # 64 GiB, above any device; elements (mb * 2^20 / 2) fit int64 sizes
    ("log", "peak_tflops"): 1e6,  # per device; an H200 is ~1e3 dense bf16: MFU stays a readable number
    ("launch", "timeout_minutes"): 10080.0,  # a week; timedelta and NCCL's milliseconds hold it easily
    ("launch", "memory_gb"): 2.0 ** 40,  # a TB of TB; bytes stay exact in float64
    ("launch", "rank"): _WORLD - 1,  # below the world size, checked once the world is known
}
_SCHEDULE_PASSES = 2 ** 20  # microbatches * pp * virtual_stages: a schedule lists ~6 actions per pass
_TRITON_GRID_Y = 65535  # CUDA's limit on a grid's second axis: the Triton attention's batch * heads axis
_PROBABILITY = {("model", "dropout")}


def validate(cfg: Config, memo=None) -> None:
    """Ranges and cross-field rules that do not depend on the world size. ``memo`` (a
    megazero.plan.memo.PlanMemo) remembers the layer balancing across the configs of one layout search."""
    src = cfg.source
    for section, key in list(_MIN) + [k for k in _MAX if k not in _MIN]:
        v = getattr(getattr(cfg, section), key)
        if v is None or v == AUTO:
            continue
        low, high = _MIN.get((section, key)), _MAX.get((section, key))
        if (low is not None and v < low) or (high is not None and v > high):
            valid = " and ".join(f"{op} {bound}" for op, bound in ((">=", low), ("<=", high)) if bound is not None)
            raise invalid(src, f"{section}.{key}", v, f"must be {valid}")
    for section, key in _PROBABILITY:
        v = getattr(getattr(cfg, section), key)
        if not 0.0 <= v < 1.0:
            raise invalid(src, f"{section}.{key}", v, "must be in [0, 1)")
    for (section, key), choices in _CHOICES.items():
        v = getattr(getattr(cfg, section), key)
        if v not in choices:
            raise invalid(src, f"{section}.{key}", v, f"valid: {' | '.join(str(c) for c in choices)}")
    m, t, par = cfg.model, cfg.train, cfg.parallel
    if isinstance(par.dp, int) and par.tp * par.pp * par.dp > _WORLD:
        raise invalid(src, "parallel.tp*pp*dp", par.tp * par.pp * par.dp,
                      f"must be <= {_WORLD} ranks (tp={par.tp}, pp={par.pp}, dp={par.dp})")
    resolve_arch(m)
    if m.hidden % m.heads:
        raise invalid(src, "model.heads", m.heads, f"must divide model.hidden={m.hidden}")
    if m.heads % m.kv_head_count:
        raise invalid(src, "model.kv_heads", m.kv_heads, f"must divide model.heads={m.heads} (query heads per k/v "
                      f"head, grouped-query attention)")
    if m.arch == "gpt2" and m.kv_head_count != m.heads:
        raise invalid(src, "model.kv_heads", m.kv_heads, f"grouped-query attention needs model.arch=llama; gpt2: "
                      f"unset or {m.heads}")
    if m.rope_scaling != "none" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        raise invalid(src, "model.rope_high_freq_factor", m.rope_high_freq_factor,
                      f"must be > model.rope_low_freq_factor={m.rope_low_freq_factor} (the band between is blended)")
    if m.rope_scaling != "none" and m.arch != "llama":
        raise invalid(src, "model.rope_scaling", m.rope_scaling, "scales rotary positions, which only llama has")
    if m.arch == "llama" and m.head_dim % 2:
        raise invalid(src, "model.heads", m.heads, f"makes an odd head dim {m.head_dim} (model.hidden / model.heads); "
                      f"rotary embeddings rotate pairs of features")
    if m.checkpoint_layers and not m.activation_checkpointing:
        raise invalid(src, "model.checkpoint_layers", m.checkpoint_layers,
                      "recomputes layers only with model.activation_checkpointing=true; 0 without it")
    _check_tp(cfg)
    _check_pp(cfg)
    heads = t.micro_batch * m.heads // par.tp
    if cfg.kernels.attention == "triton" and heads > _TRITON_GRID_Y:
        raise invalid(src, "kernels.attention", "triton",
                      f"launches micro_batch*heads/tp = {heads} programs on one grid axis, above CUDA's "
                      f"{_TRITON_GRID_Y}; lower train.micro_batch or use kernels.attention=auto")
    if cfg.zero.offload_params == "cpu" and cfg.zero.stage != 3:
        raise invalid(src, "zero.offload_params", "cpu", f"needs zero.stage=3 (got {cfg.zero.stage})")
    if cfg.zero.stage == 3 and cfg.zero.reshard_after_forward is True and cfg.parallel.schedule == "zb1p":
        raise invalid(src, "zero.reshard_after_forward", True,
                      "cannot be true with parallel.schedule=zb1p: a layer stays gathered from its input "
                      "gradient (B) to its weight gradient (W), and later forwards run in between; use auto or "
                      "false (auto is false with a pipeline)")
    if t.min_lr > t.lr:
        raise invalid(src, "train.min_lr", t.min_lr, f"must be <= train.lr={t.lr}")
    if t.global_batch % t.micro_batch:
        raise invalid(src, "train.global_batch", t.global_batch,
                      f"must be a multiple of train.micro_batch={t.micro_batch}")
    if t.resume not in ("none", "auto") and not _exists(src, "train.resume", t.resume):
        raise invalid(src, "train.resume", t.resume, "valid: none | auto | an existing checkpoint directory")
    _check_split(cfg)
    if cfg.data.tokenizer != "train" and not _exists(src, "data.tokenizer", cfg.data.tokenizer, Path.is_file):
        raise invalid(src, "data.tokenizer", cfg.data.tokenizer,
                      "valid: 'train', an existing sentencepiece .model or Hugging Face tokenizer.json file")
    if t.init_from and not _exists(src, "train.init_from", t.init_from, Path.is_dir):
        raise invalid(src, "train.init_from", t.init_from,
                      "valid: '' or an existing Hugging Face model folder (config.json and *.safetensors)")
    if t.init_from and cfg.data.tokenizer == "train":
        raise invalid(src, "data.tokenizer", "train", f"would train a new vocabulary for the weights of "
                      f"train.init_from={t.init_from}; give the model's own tokenizer (its tokenizer.json or "
                      f"sentencepiece .model)")
    for i, entry in enumerate(cfg.data.paths):
        p, key = entry_path(entry), "data.paths" if isinstance(entry, str) else f"data.paths[{i}].path"
        if not (_exists(src, key, p) or _exists(src, key, p + ".idx")):
            raise invalid(src, key, p, "no such file or directory (nor a PREFIX.bin/.idx pair)")
    if isinstance(cfg.parallel.dp, int):
        _check_batch(cfg, cfg.parallel.dp)
        _check_microbatches(cfg)
    if not cfg.log.dir:
        cfg.log.dir = str(Path("runs") / cfg.name)
    if par.pp_layers == AUTO:  # last, once every static check has passed: the FLOPs formula imports torch
        costs = pipeline_costs(m, par.tp, t.precision, compute_device(cfg.launch.device))
        args = (m.layers, par.pp, costs, par.virtual_stages)
        par.pp_layers = memo.call(balance_layers, *args) if memo is not None else balance_layers(*args)


def _exists(src: str, key: str, path: str, test=Path.exists) -> bool:
    """``test(Path(path))``, where an OS error other than 'no such file' (a name past 255 bytes, a folder
    that may not be searched) is the key's error, not a traceback: pathlib raises those."""
    try:
        return test(Path(path))
    except OSError as e:
        raise invalid(src, key, path, f"cannot be checked ({e.strerror or e})") from None


def resolve_arch(m) -> None:
    """Fix the values ``auto``/unset mean for the architecture (``models.arch``): GPT-2 has biases, a tied head
    and a 4h MLP; Llama none, an untied head and a SwiGLU MLP of 8h/3 rounded up to a multiple of 256."""
    m.bias, m.tie_embeddings, m.ffn_hidden = arch.has_bias(m), arch.tied(m), arch.ffn_hidden(m)


def _check_tp(cfg: Config) -> None:
    """Tensor parallelism splits heads, the MLP, the vocabulary and (with SP) the sequence evenly."""
    m, tp, src = cfg.model, cfg.parallel.tp, cfg.source
    if m.heads % tp:
        raise invalid(src, "model.heads", m.heads, f"must be divisible by parallel.tp={tp} (whole heads per rank)")
    kv = m.kv_head_count
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise invalid(src, "model.kv_heads", kv, f"must be a multiple or a divisor of parallel.tp={tp} (whole k/v "
                      f"heads per rank, or each k/v head on tp/kv_heads ranks)")
    if kv < tp and m.head_dim % (tp // kv):  # a checkpoint stores each replica's even share of the head
        raise invalid(src, "model.kv_heads", kv, f"puts each k/v head on {tp // kv} ranks (parallel.tp={tp}), which "
                      f"must divide the head dim {m.head_dim}")
    if m.ffn_hidden % tp:
        raise invalid(src, "model.ffn_hidden", m.ffn_hidden, f"must be divisible by parallel.tp={tp}")
    if m.padded_vocab % tp:
        raise invalid(src, "model.vocab_pad_multiple", m.vocab_pad_multiple,
                      f"pads model.vocab_size={m.vocab_size} to {m.padded_vocab}, which parallel.tp={tp} does not "
                      f"divide; use a multiple of {tp}, e.g. {128 * tp}")
    if cfg.parallel.sequence_parallel and m.seq_len % tp:
        raise invalid(src, "model.seq_len", m.seq_len,
                      f"must be divisible by parallel.tp={tp} with parallel.sequence_parallel=true")
    if cfg.parallel.tp_overlap and cfg.train.micro_batch % 2:
        raise invalid(src, "train.micro_batch", cfg.train.micro_batch,
                      "must be even with parallel.tp_overlap=true (each microbatch runs as two halves)")


def _check_pp(cfg: Config) -> None:
    """Every (virtual) pipeline stage gets at least one layer; the schedule fits the chunking."""
    m, p, src = cfg.model, cfg.parallel, cfg.source
    stages = p.pp * p.virtual_stages
    # the microbatch count is checked once dp is known (_check_microbatches); pp microbatches suit every schedule
    problem = schedule_constraint(p.schedule, p.pp, p.pp, p.virtual_stages)
    if problem and p.schedule == "interleaved":
        raise invalid(src, "parallel.schedule", p.schedule,
                      f"{problem} (got pp={p.pp}, virtual_stages={p.virtual_stages}); or use 1f1b")
    if problem:
        raise invalid(src, "parallel.virtual_stages", p.virtual_stages,
                      f"{problem}; model chunks need schedule=interleaved")
    if p.pp_layers and p.pp_layers != AUTO:
        if len(p.pp_layers) != stages or sum(p.pp_layers) != m.layers or min(p.pp_layers) < 1:
            raise invalid(src, "parallel.pp_layers", p.pp_layers,
                          f"must list {stages} counts (pp*virtual_stages), each >= 1, summing to "
                          f"model.layers={m.layers}")
    elif m.layers < stages:
        raise invalid(src, "model.layers", m.layers,
                      f"fewer layers than pipeline stages: needs >= parallel.pp*virtual_stages = {stages}")


# Memory-bound work as FLOPs-equivalents: the FLOPs a GPU would have done in the time it moves the bytes, its
# dense peak over its memory bandwidth (H200: 989 TFLOP/s bf16, 67 fp32, over 4.8 TB/s; an H100's 3.35 TB/s
# gives 295 / 20). The same bytes weigh 15x more beside 16-bit matmuls than beside fp32 ones.
FLOPS_PER_BYTE_16BIT = 200.0
FLOPS_PER_BYTE_FP32 = 14.0
# On a CPU core (fp32): ~90 GFLOP/s in a layer's matmuls against the cross entropy's ~4.3 ns per logit
# (40 bytes) measured on the 2-core development machine: ~10 FLOPs per byte.
FLOPS_PER_BYTE_CPU = 10.0
# The vocab-parallel cross entropy (parallel.tensor) reads or writes each fp32 logit of this rank's slice ten
# times: forward max, subtract (2), exp (2), sum, normalise (2); backward scale (2). The first pass is 16-bit
# casts under bf16, a little more: not counted.
CROSS_ENTROPY_BYTES_PER_LOGIT = 40
# The embedding lookup gathers a row (read, write) and its backward adds the gradient into it (read, write):
# four fp32 passes over hidden values per token, on every tp rank (the vocabulary is split, the rows are not).
EMBEDDING_BYTES_PER_VALUE = 16
# A layer's elementwise work, per token, in activation values read or written: two norms (forward 2h, backward
# 3h each) and two residual adds (forward 3h, backward 2h each), 20h; the MLP's activation function, forward 2
# and backward 3 passes over each of its ffn-wide inputs (GELU: one, SwiGLU: gate and up). Small beside a
# layer's matmuls at large h (it grows with h, they with h^2), a tenth of them at h = 256.
LAYER_PASSES_PER_HIDDEN = 20
LAYER_PASSES_PER_MLP_INPUT = 5


def pipeline_costs(m, tp: int = 1, precision: str = "fp32", device: str = "cuda") -> StageCosts:
    """What one rank computes per token (parallel.balance): a transformer layer and the output head from the
    FLOPs formula (megazero.train.metrics), plus as FLOPs-equivalents of their memory traffic the layer's
    elementwise work, the cross entropy over this rank's V/tp logits and the embedding lookup. ``m``: a model
    config (auto keys resolved or not); ``device``: cuda or cpu, whose matmuls outpace memory differently.
    Recomputation (model.activation_checkpointing) is not counted, as in the plan's FLOPs."""
    from megazero.train.metrics import flops_per_token, model_shape  # imports torch: only when asked

    ffn, shape = arch.ffn_hidden(m), model_shape(m)
    matmuls = flops_per_token(1, m.hidden, ffn, m.seq_len, 0, **shape) / tp
    head = flops_per_token(0, m.hidden, ffn, m.seq_len, m.padded_vocab, **shape) / tp
    if device == "cpu":
        per_byte = FLOPS_PER_BYTE_CPU
    else:
        per_byte = FLOPS_PER_BYTE_FP32 if precision == "fp32" else FLOPS_PER_BYTE_16BIT
    value_bytes = 4 if precision == "fp32" else 2
    mlp_inputs = 2 if arch.is_llama(m) else 1
    elementwise = (LAYER_PASSES_PER_HIDDEN * m.hidden + LAYER_PASSES_PER_MLP_INPUT * mlp_inputs * ffn / tp)
    layer = matmuls + elementwise * value_bytes * per_byte
    loss = CROSS_ENTROPY_BYTES_PER_LOGIT * per_byte * m.padded_vocab / tp
    return StageCosts(layer, EMBEDDING_BYTES_PER_VALUE * per_byte * m.hidden, head + loss)


def compute_device(launch_device: str) -> str:
    """launch.device as the cost model sees it: auto weighs memory traffic as a GPU does, whatever machine
    validates the config (a --dry-run on a login node plans the GPU run), and without touching CUDA."""
    return "cpu" if launch_device == "cpu" else "cuda"


def _check_microbatches(cfg: Config) -> None:
    """The schedule can be built (and listed, by the dry run) in seconds and fits the chunking."""
    p = cfg.parallel
    passes = cfg.microbatches * p.pp * p.virtual_stages
    if passes > _SCHEDULE_PASSES:
        raise invalid(cfg.source, "train.global_batch", cfg.train.global_batch,
                      f"gives {cfg.microbatches} microbatches per rank (global_batch / (micro_batch*dp)); times "
                      f"parallel.pp*virtual_stages={p.pp * p.virtual_stages} that is {passes} forward passes per "
                      f"step, above {_SCHEDULE_PASSES}; raise train.micro_batch or lower global_batch")
    problem = schedule_constraint(p.schedule, p.pp, cfg.microbatches, p.virtual_stages)
    if problem:  # the name and the chunking passed _check_pp: what is left is the microbatch count
        raise invalid(cfg.source, "train.global_batch", cfg.train.global_batch,
                      f"gives {cfg.microbatches} microbatches per rank (global_batch / (micro_batch*dp)); {problem}")


def _check_split(cfg: Config) -> None:
    """data.split as the data loader parses it; a validation weight of 0 (no validation set) leaves nothing
    for train.eval_every to evaluate on, which would otherwise fail only at the first evaluation."""
    _, w_val = parse_split(cfg.data.split, cfg.source)
    if w_val == 0 and cfg.train.eval_every:
        raise invalid(cfg.source, "data.split", cfg.data.split,
                      f"validation weight 0 leaves no validation data, but train.eval_every={cfg.train.eval_every} "
                      "evaluates on it; give validation a weight (e.g. '98,2') or set train.eval_every=0")


def _check_batch(cfg: Config, dp: int) -> None:
    t = cfg.train
    per_step = t.micro_batch * dp
    if t.global_batch % per_step:
        raise invalid(cfg.source, "train.global_batch", t.global_batch,
                      f"must be a multiple of train.micro_batch*parallel.dp = {t.micro_batch}*{dp} = {per_step}")


def resolve_world(cfg: Config, world_size: int) -> Config:
    """Fix parallel.dp for this world size and check tp*pp*dp covers it exactly; fix the values that
    depend on the layout (zero.reshard_after_forward=auto)."""
    p = cfg.parallel
    src = cfg.source
    if p.dp == AUTO:
        if world_size % (p.tp * p.pp):
            raise invalid(src, "parallel.tp*pp", p.tp * p.pp,
                          f"must divide the world size {world_size} (parallel.dp=auto)")
        p.dp = world_size // (p.tp * p.pp)
    if p.tp * p.pp * p.dp != world_size:
        raise UserError(f"{src}: parallel.tp*pp*dp = {p.tp}*{p.pp}*{p.dp} = {p.tp * p.pp * p.dp} "
                        f"does not match the world size {world_size}; set parallel.dp=auto or launch "
                        f"{p.tp * p.pp * p.dp} processes")
    _check_batch(cfg, p.dp)
    _check_microbatches(cfg)
    if cfg.zero.reshard_after_forward == AUTO:
        # A pipeline stage runs m forwards and m backwards per step: resharding after every forward would
        # gather each layer 2m times per step instead of once (torchtitan reshards only without pp).
        cfg.zero.reshard_after_forward = p.pp == 1
    return cfg
