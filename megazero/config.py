"""One YAML file describes a run: typed sections, checked before anything is allocated.

Every check that can be made from the file and the world size is made before
anything starts (the rules live in megazero.rules), so a typo costs a second,
not a queue slot on a cluster. Errors are one line (megazero.errors.invalid):
the file, the key, the bad value (cut short) and what would be valid.

This module reads and types the values; megazero.rules checks them:
``load_config`` ends with its ``validate``, and its ``resolve_world`` (also
importable from here) fixes what depends on the world size. Imports go one
way, config -> rules -> errors: megazero.rules imports nothing from here.

Files and ``--set`` values are untrusted: megazero.yaml_load reads them (YAML 1.2 core schema; no
aliases, tags, merge keys or duplicate keys; bounded size and depth), values are strictly typed here,
and every number has a range in megazero.rules. An empty file, or a section whose keys are all
commented out, means the defaults.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from megazero.data_paths import parse_data_paths
from megazero.errors import UserError, invalid, shown, shown_name
from megazero.rules import AUTO, resolve_world, validate  # noqa: F401 (resolve_world: re-exported for callers)
from megazero.yaml_load import YamlSyntaxError, load_yaml, read_config_text

MAX_STR = 4096  # characters in a string value: PATH_MAX on Linux; a longer path fails in the OS anyway
MAX_LIST = 65536  # entries in a list value (data.paths, parallel.pp_layers)


@dataclass
class ModelConfig:
    arch: str = "gpt2"  # gpt2 | llama (RMSNorm, rotary positions, SwiGLU, grouped-query attention)
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    seq_len: int = 64
    vocab_size: int = 512
    ffn_hidden: Union[int, None] = None  # None -> 4 * hidden (gpt2); 8/3 * hidden rounded up to 256 (llama)
    kv_heads: Union[int, None] = None  # grouped-query attention: k/v heads, dividing heads; None -> heads
    bias: Union[bool, str] = AUTO  # auto: true for gpt2, false for llama
    tie_embeddings: Union[bool, str] = AUTO  # output head = token embedding; auto: true for gpt2, false for llama
    norm_eps: float = 1e-5  # the LayerNorm / RMSNorm epsilon
    rope_theta: float = 10000.0  # llama: the base of the rotary position frequencies (Su et al. 2021)
    # llama: none | llama3, Llama 3.1's frequency scaling for long context (the four keys below, as its
    # config.json's rope_scaling): frequencies whose wavelength exceeds original_positions/low_freq_factor are
    # divided by rope_factor, those below original_positions/high_freq_factor kept, the band between blended
    rope_scaling: str = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_positions: int = 8192
    dropout: float = 0.0
    activation_checkpointing: bool = False
    # with activation_checkpointing: recompute only the first k layers of each model chunk (Megatron's
    # --recompute-num-layers, block method), trading memory for compute in steps; 0: every layer
    checkpoint_layers: int = 0
    init_std: float = 0.02
    vocab_pad_multiple: int = 128

    # The keys that define the network a checkpoint holds; the others (dropout, activation checkpointing,
    # init_std) may change between a save and a resume.
    ARCHITECTURE = ("arch", "layers", "hidden", "heads", "kv_heads", "seq_len", "vocab_size", "ffn_hidden", "bias",
                    "tie_embeddings", "norm_eps", "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor",
                    "rope_high_freq_factor", "rope_original_positions", "vocab_pad_multiple")

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

    @property
    def kv_head_count(self) -> int:
        """k/v heads: ``kv_heads``, or every head (multi-head attention) when unset."""
        return self.kv_heads or self.heads


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: Union[int, str] = AUTO  # "auto" = world_size / (tp * pp), resolved at launch
    sequence_parallel: bool = False  # split norms/dropout along the sequence over tp (Korthikanti et al. 2022)
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zb1p
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved)
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
    # pipeline, false with one (each layer would be gathered 2m times per step), fixed by resolve_world
    reshard_after_forward: Union[bool, str] = AUTO
    offload_optimizer: str = "none"  # none | cpu: fp32 master weights and Adam states in CPU memory
    offload_params: str = "none"  # none | cpu (stage 3): parameter shards in CPU memory
    # the dtype gradients are accumulated over microbatches and reduced over dp in: auto = fp32 under bf16
    # (as Megatron-LM: bf16 sums of many microbatches lose bits), else the model's
    grad_dtype: str = "auto"  # auto | fp32 | model


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
    on_nonfinite: str = "stop"  # stop | skip: a non-finite loss or gradient norm stops the run, or skips the update
    max_skipped: int = 10  # consecutive skipped updates before the run stops (fp16: at the minimum loss scale)
    async_save: bool = False  # write checkpoints in the background while training goes on
    init_from: str = ""  # a Hugging Face model folder (GPT-2 or Llama) the weights start from; optimizer fresh


@dataclass
class DataConfig:
    paths: list = field(default_factory=list)  # paths, or {path, weight, name} mappings (megazero.data_paths)
    text_key: str = "text"  # the field of a .jsonl/.parquet record that holds the document
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
    overwrite: bool = False  # a fresh run may replace an earlier run's checkpoints and logs in log.dir


@dataclass
class KernelsConfig:
    attention: str = AUTO  # auto | triton | torch: auto = torch SDPA (cuDNN on Hopper: faster than the Triton kernel)
    adam: str = AUTO  # auto | fused | triton | torch: the optimizer step over flat buffers


@dataclass
class LaunchConfig:
    device: str = AUTO  # auto | cpu | cuda
    timeout_minutes: float = 30.0  # a collective that waits longer than this stops the run
    memory_gb: float = 0.0  # --simulate: the memory a rank may use (0: this machine's device, or its RAM)
    rank: int = -1  # --simulate: the one rank to simulate (-1: one rank of each memory class)


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


_SECTION_CLASSES = {
    "model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig,
    "data": DataConfig, "log": LogConfig, "launch": LaunchConfig, "zero": ZeroConfig,
    "kernels": KernelsConfig,
}

def _type_name(t: Any) -> str:
    return {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
            "list": "a list"}.get(t, t)


def _coerce(source: str, section: str, key: str, value: Any, annotation: str) -> Any:
    """Check one value against its field's annotation (kept as a string by `from __future__`).

    Strictly typed: a quoted "10" is no integer and "1e-3" no number (the YAML loader reads unquoted
    numbers as numbers); ranges are megazero.rules' job.
    """
    full = f"{section}.{key}"
    if (section, key) == ("parallel", "pp_layers"):
        return _layer_counts(source, full, value)
    if (section, key) == ("data", "paths"):
        if isinstance(value, list) and len(value) > MAX_LIST:
            raise invalid(source, full, value, f"at most {MAX_LIST} entries")
        return parse_data_paths(source, full, value, _text)
    ann = annotation.replace("typing.", "")
    allows_none = "None" in ann
    allows_auto = "str" in ann and ann.startswith("Union") and (section, key) != ("train", "resume")
    if value is None and allows_none:
        return None
    if isinstance(value, str) and allows_auto and ann != "str":
        if value == AUTO:
            return value
        raise invalid(source, full, value, f"expected {_type_name(_base(ann))} or 'auto'")
    base = _base(ann)
    or_auto = " or 'auto'" if allows_auto else ""
    if base == "bool":
        if isinstance(value, bool):
            return value
        raise invalid(source, full, value, f"expected true or false{or_auto}")
    if base == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise invalid(source, full, value, f"expected an integer{or_auto}")
    if base == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer past 1.8e308
                number = math.inf
            if math.isfinite(number):
                return number
        raise invalid(source, full, value, f"expected a finite number{or_auto}")
    if base == "str":
        return _text(source, full, value, "expected a string")
    if base == "list":
        if isinstance(value, list) and len(value) > MAX_LIST:
            raise invalid(source, full, value, f"at most {MAX_LIST} entries")
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return [_text(source, full, v, "expected a list of paths") for v in value]
        raise invalid(source, full, value, "expected a list of paths")
    raise AssertionError(f"unhandled annotation {annotation} for {full}")


def _layer_counts(source: str, full: str, value: Any) -> Union[list, str]:
    """parallel.pp_layers: a list of integers (their ranges are megazero.rules'), or auto."""
    if isinstance(value, list) and len(value) > MAX_LIST:
        raise invalid(source, full, value, f"at most {MAX_LIST} entries")
    if value == AUTO or (isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                                         for v in value)):
        return list(value) if isinstance(value, list) else value
    raise invalid(source, full, value, "expected a list of layer counts, one per (virtual) stage, or auto")


def _text(source: str, full: str, value: Any, expected: str) -> str:
    """A string that can name a file: bounded, UTF-8, without control characters.

    NUL makes os calls raise ValueError, a newline splits one-line messages, a lone surrogate cannot be
    encoded for the OS, and a path longer than PATH_MAX fails there with a traceback-worthy OSError.
    """
    if not isinstance(value, str):
        raise invalid(source, full, value, expected)
    if len(value) > MAX_STR:
        raise invalid(source, full, value, f"{len(value)} characters; at most {MAX_STR}")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise invalid(source, full, value, "must not contain a control character (NUL, newline, tab, ...)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(source, full, value, "not valid UTF-8 text (a lone surrogate)") from None
    return value


def _base(ann: str) -> str:
    for t in ("bool", "int", "float", "list", "str"):
        if ann == t or ann.startswith(f"Union[{t}") or ann.startswith(t):
            return t
    return ann


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word[:100], list(options), n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{hint}valid: {', '.join(sorted(options))}"


def _apply(cfg: Config, section: str, key: str, value: Any, source: str) -> None:
    """Set ``section.key`` to ``value`` after checking the names and the value's type (not its range)."""
    if section not in _SECTION_CLASSES:
        raise UserError(f"{source}: unknown section {shown(section)}; {_suggest(str(section), _SECTION_CLASSES)}")
    obj = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if key not in fields:
        raise UserError(f"{source}: unknown key {shown(f'{section}.{key}')}; {_suggest(str(key), fields)}")
    setattr(obj, key, _coerce(source, section, key, value, str(fields[key].type)))


def parse_set(item: str) -> tuple[str, str, Any]:
    """`section.key=value` from the command line; the value is read as YAML (so 2 is an int).

    A value that is not YAML at all (``[a``) is taken as its text; one the loader refuses (``010``, an
    alias, a tag, deep nesting) is an error, as in a file.
    """
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise UserError(f"--set {shown(item)} is invalid; expected section.key=value, e.g. train.steps=10")
    lhs, raw = item.split("=", 1)
    section, key = lhs.split(".", 1)
    if raw == "":
        return section.strip(), key.strip(), ""
    try:
        value = load_yaml(raw, f"--set {shown_name(lhs.strip())}", lines=False)
    except YamlSyntaxError:
        value = raw
    return section.strip(), key.strip(), value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a YAML config, apply `--set` overrides and validate all that needs no process group."""
    cfg = Config()
    source = "<defaults>"
    if path is not None:
        source = shown_name(str(path))
        raw = load_yaml(read_config_text(path), source)
        if raw is None:  # an empty file (or only comments): the defaults
            raw = {}
        if not isinstance(raw, dict):
            raise UserError(f"{source}: holds {shown(raw)}; expected a mapping of sections "
                            f"({', '.join(_SECTION_CLASSES)})")
        cfg.name = Path(path).stem
        for section, values in raw.items():
            if section not in _SECTION_CLASSES:
                raise UserError(f"{source}: unknown section {shown(section)}; "
                                f"{_suggest(str(section), _SECTION_CLASSES)}")
            if values is None:  # a section whose keys are all commented out
                continue
            if not isinstance(values, dict):
                raise UserError(f"{source}: section '{section}' is {shown(values)}; expected a mapping of "
                                "key: value")
            for key, value in values.items():
                if not isinstance(key, str):
                    names = [f.name for f in dataclasses.fields(getattr(cfg, section))]
                    raise UserError(f"{source}: unknown key {shown(key)} in section '{section}'; "
                                    f"valid: {', '.join(sorted(names))}")
                _apply(cfg, section, key, value, source)
    cfg.source = source
    for item in overrides:
        section, key, value = parse_set(item)
        _apply(cfg, section, key, value, f"{source} (--set)")
    validate(cfg)
    return cfg
