"""The rules a config must obey: ranges, choices and cross-field constraints, world size included.

Checked before any process group or allocation (``megazero.config.load_config``
calls :func:`validate`; the launcher calls :func:`resolve_world` once the world
size is known). Every failure is one line naming the file, the key, the value
and what would be valid.
"""
from __future__ import annotations

from pathlib import Path

from megazero.config import AUTO, Config, _fail
from megazero.errors import UserError

# Allowed values and ranges, per key. A key absent here only needs the right type.
_CHOICES = {
    ("train", "precision"): ("fp32", "bf16", "fp16"),
    ("zero", "stage"): (0, 1, 2, 3),
    ("zero", "offload_optimizer"): ("none", "cpu"),
    ("zero", "offload_params"): ("none", "cpu"),
    ("zero", "grad_dtype"): ("auto", "fp32", "model"),
    ("kernels", "attention"): ("auto", "triton", "torch"),
    ("kernels", "adam"): ("auto", "triton", "torch"),
    ("launch", "device"): ("auto", "cpu", "cuda"),
    ("parallel", "schedule"): ("gpipe", "1f1b", "interleaved"),
}
_MIN = {
    ("model", "layers"): 1, ("model", "hidden"): 1, ("model", "heads"): 1, ("model", "seq_len"): 1,
    ("model", "vocab_size"): 2, ("model", "ffn_hidden"): 1, ("model", "vocab_pad_multiple"): 1,
    ("parallel", "tp"): 1, ("parallel", "pp"): 1, ("parallel", "dp"): 1, ("parallel", "virtual_stages"): 1,
    ("train", "steps"): 1, ("train", "global_batch"): 1, ("train", "micro_batch"): 1,
    ("train", "lr"): 0.0, ("train", "min_lr"): 0.0, ("train", "warmup_steps"): 0,
    ("train", "weight_decay"): 0.0, ("train", "grad_clip"): 0.0, ("train", "seed"): 0,
    ("train", "eval_every"): 0, ("train", "eval_batches"): 1, ("train", "save_every"): 0,
    ("train", "keep_last"): 1, ("train", "exit_after"): 0, ("zero", "bucket_mb"): 0.001,
    ("parallel", "world_size"): 0, ("log", "every"): 1, ("model", "init_std"): 0.0,
    ("log", "peak_tflops"): 1e-9,
}
_PROBABILITY = {("model", "dropout")}


def validate(cfg: Config) -> None:
    """Ranges and cross-field rules that do not depend on the world size."""
    src = cfg.source
    for (section, key), low in _MIN.items():
        v = getattr(getattr(cfg, section), key)
        if v is None or v == AUTO:
            continue
        if v < low:
            raise _fail(src, f"{section}.{key}", v, f"must be >= {low}")
    for section, key in _PROBABILITY:
        v = getattr(getattr(cfg, section), key)
        if not 0.0 <= v < 1.0:
            raise _fail(src, f"{section}.{key}", v, "must be in [0, 1)")
    for (section, key), choices in _CHOICES.items():
        v = getattr(getattr(cfg, section), key)
        if v not in choices:
            raise _fail(src, f"{section}.{key}", v, f"valid: {' | '.join(str(c) for c in choices)}")
    m, t = cfg.model, cfg.train
    if m.ffn_hidden is None:
        m.ffn_hidden = 4 * m.hidden
    if m.hidden % m.heads:
        raise _fail(src, "model.heads", m.heads, f"must divide model.hidden={m.hidden}")
    _check_tp(cfg)
    _check_pp(cfg)
    if cfg.zero.offload_params == "cpu" and cfg.zero.stage != 3:
        raise _fail(src, "zero.offload_params", "cpu", f"needs zero.stage=3 (got {cfg.zero.stage})")
    if t.min_lr > t.lr:
        raise _fail(src, "train.min_lr", t.min_lr, f"must be <= train.lr={t.lr}")
    if t.global_batch % t.micro_batch:
        raise _fail(src, "train.global_batch", t.global_batch,
                    f"must be a multiple of train.micro_batch={t.micro_batch}")
    if t.resume not in ("none", "auto") and not Path(t.resume).exists():
        raise _fail(src, "train.resume", t.resume, "valid: none | auto | an existing checkpoint directory")
    _check_split(src, cfg.data.split)
    if cfg.data.tokenizer != "train" and not Path(cfg.data.tokenizer).is_file():
        raise _fail(src, "data.tokenizer", cfg.data.tokenizer, "valid: 'train' or an existing sentencepiece .model file")
    for p in cfg.data.paths:
        if not (Path(p).exists() or Path(p + ".idx").exists()):
            raise _fail(src, "data.paths", p, "no such file or directory (nor a PREFIX.bin/.idx pair)")
    if isinstance(cfg.parallel.dp, int):
        _check_batch(cfg, cfg.parallel.dp)
        _check_microbatches(cfg)
    if not cfg.log.dir:
        cfg.log.dir = str(Path("runs") / cfg.name)


def _check_tp(cfg: Config) -> None:
    """Tensor parallelism splits heads, the MLP, the vocabulary and (with SP) the sequence evenly."""
    m, tp, src = cfg.model, cfg.parallel.tp, cfg.source
    if m.heads % tp:
        raise _fail(src, "model.heads", m.heads, f"must be divisible by parallel.tp={tp} (whole heads per rank)")
    if m.ffn_hidden % tp:
        raise _fail(src, "model.ffn_hidden", m.ffn_hidden, f"must be divisible by parallel.tp={tp}")
    if m.padded_vocab % tp:
        raise _fail(src, "model.vocab_pad_multiple", m.vocab_pad_multiple,
                    f"pads model.vocab_size={m.vocab_size} to {m.padded_vocab}, which parallel.tp={tp} does not "
                    f"divide; use a multiple of {tp}, e.g. {128 * tp}")
    if cfg.parallel.sequence_parallel and m.seq_len % tp:
        raise _fail(src, "model.seq_len", m.seq_len,
                    f"must be divisible by parallel.tp={tp} with parallel.sequence_parallel=true")


def _check_pp(cfg: Config) -> None:
    """Every (virtual) pipeline stage gets at least one layer; the schedule fits the chunking."""
    m, p, src = cfg.model, cfg.parallel, cfg.source
    stages = p.pp * p.virtual_stages
    if p.schedule == "interleaved" and (p.pp < 2 or p.virtual_stages < 2):
        raise _fail(src, "parallel.schedule", p.schedule,
                    f"interleaved needs parallel.pp >= 2 and parallel.virtual_stages >= 2 "
                    f"(got pp={p.pp}, virtual_stages={p.virtual_stages}); or use 1f1b")
    if p.schedule != "interleaved" and p.virtual_stages != 1:
        raise _fail(src, "parallel.virtual_stages", p.virtual_stages,
                    f"must be 1 with parallel.schedule={p.schedule}; model chunks need schedule=interleaved")
    if p.pp_layers:
        if len(p.pp_layers) != stages or sum(p.pp_layers) != m.layers or min(p.pp_layers) < 1:
            raise _fail(src, "parallel.pp_layers", p.pp_layers,
                        f"must list {stages} counts (pp*virtual_stages), each >= 1, summing to model.layers={m.layers}")
    elif m.layers < stages:
        raise _fail(src, "model.layers", m.layers,
                    f"fewer layers than pipeline stages: needs >= parallel.pp*virtual_stages = {stages}")


def _check_microbatches(cfg: Config) -> None:
    p = cfg.parallel
    if p.schedule == "interleaved" and cfg.microbatches % p.pp:
        raise _fail(cfg.source, "train.global_batch", cfg.train.global_batch,
                    f"gives {cfg.microbatches} microbatches per rank (global_batch / (micro_batch*dp)); the "
                    f"interleaved schedule needs a multiple of parallel.pp={p.pp}")


def _check_split(src: str, split: str) -> None:
    try:
        parts = [float(x) for x in str(split).split(",")]
    except ValueError:
        parts = []
    if len(parts) != 2 or min(parts) < 0 or parts[0] <= 0 or parts[1] <= 0:
        raise _fail(src, "data.split", split, "expected 'train,validation' weights, both > 0, e.g. '98,2'")


def _check_batch(cfg: Config, dp: int) -> None:
    t = cfg.train
    per_step = t.micro_batch * dp
    if t.global_batch % per_step:
        raise _fail(cfg.source, "train.global_batch", t.global_batch,
                    f"must be a multiple of train.micro_batch*parallel.dp = {t.micro_batch}*{dp} = {per_step}")


def resolve_world(cfg: Config, world_size: int) -> Config:
    """Fix parallel.dp for this world size and check tp*pp*dp covers it exactly."""
    p = cfg.parallel
    src = cfg.source
    if p.dp == AUTO:
        if world_size % (p.tp * p.pp):
            raise _fail(src, "parallel.tp*pp", p.tp * p.pp,
                        f"must divide the world size {world_size} (parallel.dp=auto)")
        p.dp = world_size // (p.tp * p.pp)
    if p.tp * p.pp * p.dp != world_size:
        raise UserError(f"{src}: parallel.tp*pp*dp = {p.tp}*{p.pp}*{p.dp} = {p.tp * p.pp * p.dp} "
                        f"does not match the world size {world_size}; set parallel.dp=auto or launch "
                        f"{p.tp * p.pp * p.dp} processes")
    _check_batch(cfg, p.dp)
    _check_microbatches(cfg)
    return cfg
