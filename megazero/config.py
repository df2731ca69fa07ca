"""One YAML file describes a run: typed sections, checked before anything is allocated.

Every check that can be made from the file and the world size is made here,
so a typo costs a second, not a queue slot on a cluster. Errors are one line:
the file, the key, the bad value and what would be valid.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

from megazero.errors import UserError

AUTO = "auto"


@dataclass
class ModelConfig:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    seq_len: int = 64
    vocab_size: int = 512
    ffn_hidden: Union[int, None] = None  # None -> 4 * hidden
    bias: bool = True
    dropout: float = 0.0
    activation_checkpointing: bool = False
    init_std: float = 0.02
    vocab_pad_multiple: int = 128

    @property
    def padded_vocab(self) -> int:
        """Embedding rows: vocab_size rounded up to a multiple of vocab_pad_multiple (128).

        Independent of tp, so a checkpoint moves between tensor-parallel sizes
        (Megatron pads to 128*tp, which ties checkpoints to tp); tp must divide
        it, which config validation checks.
        """
        multiple = self.vocab_pad_multiple
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: Union[int, str] = AUTO  # "auto" = world_size / (tp * pp), resolved at launch
    sequence_parallel: bool = False  # split norms/dropout along the sequence over tp (Korthikanti et al. 2022)
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved)
    pp_layers: list = field(default_factory=list)  # explicit layers per (virtual) stage; [] = balanced
    world_size: int = 0  # 0 = the launcher's; set it to plan a run of another size with --dry-run


@dataclass
class ZeroConfig:
    stage: int = 0  # 0 | 1 | 2 | 3 (Rajbhandari et al. 2020)
    bucket_mb: float = 25.0  # gradient/parameter communication bucket size
    reshard_after_forward: bool = True  # stage 3: free gathered layers after forward (False: keep for the step)
    offload_optimizer: str = "none"  # none | cpu: fp32 master weights and Adam states in CPU memory
    offload_params: str = "none"  # none | cpu (stage 3): parameter shards in CPU memory


@dataclass
class TrainConfig:
    steps: int = 100
    global_batch: int = 8
    micro_batch: int = 8
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    precision: str = "fp32"
    seed: int = 1234
    eval_every: int = 0  # 0 disables evaluation
    eval_batches: int = 1
    save_every: int = 0  # 0: save only at the end
    keep_last: int = 2
    resume: str = "none"  # none | auto | a checkpoint path
    exit_after: int = 0  # stop (and save) after this many steps of this job, e.g. for time-limited slots; 0 = never


@dataclass
class DataConfig:
    paths: list = field(default_factory=list)
    tokenizer: str = "train"
    split: str = "98,2"
    cache_dir: str = ".cache/megazero"


@dataclass
class LogConfig:
    dir: str = ""  # "" -> runs/<config name>
    every: int = 1
    tensorboard: bool = True
    peak_tflops: Union[float, str] = AUTO  # per device, for MFU; auto = known GPU table or a measured CPU matmul
    pipeline_trace: bool = False  # write pipeline_trace.json (Chrome trace / Perfetto) of the last step


@dataclass
class KernelsConfig:
    attention: str = AUTO  # auto | triton | torch: auto = Triton on CUDA when importable, else torch SDPA
    adam: str = AUTO  # auto | triton | torch: the optimizer step over flat buffers


@dataclass
class LaunchConfig:
    device: str = AUTO  # auto | cpu | cuda


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
    name: str = "run"
    source: str = "<config>"  # the file it came from, for error messages

    @property
    def microbatches(self) -> int:
        """Microbatches each DP rank runs per step (gradient accumulation)."""
        assert isinstance(self.parallel.dp, int), "resolve_world() first"
        return self.train.global_batch // (self.train.micro_batch * self.parallel.dp)

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            if f.name in ("name", "source"):
                continue
            out[f.name] = dataclasses.asdict(getattr(self, f.name))
        out["name"] = self.name
        return out


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config) if f.name not in ("name", "source")}
_SECTION_CLASSES = {
    "model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig,
    "data": DataConfig, "log": LogConfig, "launch": LaunchConfig, "zero": ZeroConfig,
    "kernels": KernelsConfig,
}

# Allowed values and ranges, per key. A key absent here only needs the right type.
_CHOICES = {
    ("train", "precision"): ("fp32", "bf16", "fp16"),
    ("zero", "stage"): (0, 1, 2, 3),
    ("zero", "offload_optimizer"): ("none", "cpu"),
    ("zero", "offload_params"): ("none", "cpu"),
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
}
_PROBABILITY = {("model", "dropout")}


def _fail(source: str, key: str, value: Any, valid: str) -> UserError:
    return UserError(f"{source}: {key}={value!r} is invalid; {valid}")


def _type_name(t: Any) -> str:
    return {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
            "list": "a list"}.get(t, t)


def _coerce(source: str, section: str, key: str, value: Any, annotation: str) -> Any:
    """Check one value against its field's annotation (kept as a string by `from __future__`)."""
    full = f"{section}.{key}"
    ann = annotation.replace("typing.", "")
    allows_none = "None" in ann
    allows_auto = "str" in ann and ann.startswith("Union") and (section, key) != ("train", "resume")
    if value is None and allows_none:
        return None
    if isinstance(value, str) and allows_auto and ann != "str":
        if value == AUTO:
            return value
        raise _fail(source, full, value, f"expected {_type_name(_base(ann))} or 'auto'")
    base = _base(ann)
    if base == "bool":
        if isinstance(value, bool):
            return value
        raise _fail(source, full, value, "expected true or false")
    if base == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _fail(source, full, value, "expected an integer")
    if base == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise _fail(source, full, value, "expected a number")
    if base == "str":
        if isinstance(value, str):
            return value
        raise _fail(source, full, value, "expected a string")
    if base == "list":
        if (section, key) == ("parallel", "pp_layers"):
            if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                return list(value)
            raise _fail(source, full, value, "expected a list of layer counts, one per (virtual) stage")
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise _fail(source, full, value, "expected a list of paths")
    raise AssertionError(f"unhandled annotation {annotation} for {full}")


def _base(ann: str) -> str:
    for t in ("bool", "int", "float", "list", "str"):
        if ann == t or ann.startswith(f"Union[{t}") or ann.startswith(t):
            return t
    return ann


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{hint}valid: {', '.join(sorted(options))}"


def _apply(cfg: Config, section: str, key: str, value: Any, source: str) -> None:
    if section not in _SECTION_CLASSES:
        raise UserError(f"{source}: unknown section '{section}'; {_suggest(section, _SECTION_CLASSES)}")
    obj = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if key not in fields:
        raise UserError(f"{source}: unknown key '{section}.{key}'; {_suggest(key, fields)}")
    setattr(obj, key, _coerce(source, section, key, value, str(fields[key].type)))


def parse_set(item: str) -> tuple[str, str, Any]:
    """`section.key=value` from the command line; the value is read as YAML (so 2 is an int)."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise UserError(f"--set {item!r} is invalid; expected section.key=value, e.g. train.steps=10")
    lhs, raw = item.split("=", 1)
    section, key = lhs.split(".", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return section.strip(), key.strip(), value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a YAML config, apply `--set` overrides and validate all that needs no process group."""
    cfg = Config()
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        source = str(path)
        if not p.is_file():
            raise UserError(f"--config {str(path)!r}: no such file")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise UserError(f"{source}: not valid YAML{where}") from None
        if not isinstance(raw, dict):
            raise UserError(f"{source}: expected a mapping of sections (model, parallel, train, data, log, launch)")
        cfg.name = p.stem
        for section, values in raw.items():
            if section not in _SECTION_CLASSES:
                raise UserError(f"{source}: unknown section '{section}'; {_suggest(str(section), _SECTION_CLASSES)}")
            if not isinstance(values, dict):
                raise UserError(f"{source}: section '{section}' must be a mapping of key: value")
            for key, value in values.items():
                _apply(cfg, section, str(key), value, source)
    cfg.source = source
    for item in overrides:
        section, key, value = parse_set(item)
        _apply(cfg, section, key, value, f"{source} (--set)")
    validate(cfg)
    return cfg


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
