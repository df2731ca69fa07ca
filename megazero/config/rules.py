"""The rules a config must obey: ranges, choices and cross-field constraints, world size included.

Pure checks: nothing here writes to the config (megazero.config.resolve fixes the derived values, once per
run). ``megazero.config.load.load_config`` calls :func:`validate` before any process group or allocation;
:func:`world_dp` checks a world size against the layout, and :func:`check_model` checks a model section
alone (a checkpoint's, megazero.checkpoint.meta). Every failure is one line naming the file, the key, the
value and what would be valid (``megazero.errors.invalid``). Each key's range or choice list is in
megazero.config.ranges. Values that have a parser of their own — the schedule
(``parallel.schedules``), ``data.split`` (``megazero.data.samples``) — are checked by calling it, so a config
passes here exactly when the run accepts it.

Imports go one way: ``megazero.config.load`` imports this module, which reads the config it is handed and
imports nothing from ``megazero.config.load``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from megazero.config.data_paths import entry_path
from megazero.config.ranges import MAX_WORLD, check_ranges
from megazero.config.context_rules import check_context
from megazero.config.recovery_rules import check_recovery
from megazero.config.zero_rules import check_zero
from megazero.config.schema import AUTO, Config, ModelConfig
from megazero.data.samples import parse_split
from megazero.errors import UserError, invalid
from megazero.models import arch
from megazero.parallel.schedules import schedule_constraint


_SCHEDULE_PASSES = 2 ** 20  # microbatches * pp * virtual_stages: a schedule lists ~6 actions per pass
TRITON_GRID_Y = 65535  # CUDA's limit on a grid's second axis: the Triton attention's batch * heads axis


def check_model(cfg: Config, source: Optional[str] = None) -> None:
    """The model section's own rules, without the rest of the config: its ranges and choices, then how its
    keys constrain each other (what a checkpoint's stored model must obey as much as a config file's)."""
    check_ranges(cfg, ("model",), source)
    _check_model_rules(cfg, cfg.source if source is None else source)


def validate(cfg: Config) -> None:
    """Ranges and cross-field rules that do not depend on the world size; writes nothing."""
    src = cfg.source
    check_ranges(cfg)
    t, par = cfg.train, cfg.parallel
    if isinstance(par.dp, int) and par.tp * par.pp * par.dp * par.cp > MAX_WORLD:
        raise invalid(src, "parallel.tp*pp*dp*cp", par.tp * par.pp * par.dp * par.cp,
                      f"must be <= {MAX_WORLD} ranks (tp={par.tp}, pp={par.pp}, dp={par.dp}, cp={par.cp})")
    _check_model_rules(cfg, src)
    _check_tp(cfg)
    _check_pp(cfg)
    heads = t.micro_batch * cfg.model.heads // par.tp
    if cfg.kernels.attention == "triton" and heads > TRITON_GRID_Y:
        raise invalid(src, "kernels.attention", "triton",
                      f"launches micro_batch*heads/tp = {heads} programs on one grid axis, above CUDA's "
                      f"{TRITON_GRID_Y}; lower train.micro_batch or use kernels.attention=auto")
    check_zero(cfg)
    _check_compile(cfg)
    check_recovery(cfg)
    if t.min_lr > t.lr:
        raise invalid(src, "train.min_lr", t.min_lr, f"must be <= train.lr={t.lr}")
    if t.global_batch % t.micro_batch:
        raise invalid(src, "train.global_batch", t.global_batch,
                      f"must be a multiple of train.micro_batch={t.micro_batch}")
    _check_paths(cfg)
    if isinstance(cfg.parallel.dp, int):
        _check_batch(cfg, cfg.parallel.dp)
        _check_microbatches(cfg, cfg.parallel.dp)


def _check_model_rules(cfg: Config, src: str) -> None:
    """How the model's keys constrain each other (heads, k/v heads, rotary scaling, recomputation), then what its
    architecture cannot build (its spec's rules: ``ModelSpec.rules``)."""
    m = cfg.model
    if m.hidden % m.heads and m.head_dim is None:
        raise invalid(src, "model.heads", m.heads, f"must divide model.hidden={m.hidden} (or set model.head_dim)")
    if m.heads % m.kv_head_count:
        raise invalid(src, "model.kv_heads", m.kv_heads, f"must divide model.heads={m.heads} (query heads per k/v "
                      f"head, grouped-query attention)")
    if m.rope_scaling != "none" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        raise invalid(src, "model.rope_high_freq_factor", m.rope_high_freq_factor,
                      f"must be > model.rope_low_freq_factor={m.rope_low_freq_factor} (the band between is blended)")
    for refusal in m.spec.rules(m):
        raise invalid(src, refusal.key, refusal.value, refusal.why)
    if m.checkpoint_layers and not m.activation_checkpointing:
        raise invalid(src, "model.checkpoint_layers", m.checkpoint_layers,
                      "recomputes layers only with model.activation_checkpointing=true; 0 without it")
    _check_moe_model(m, src)


def _check_moe_model(m: ModelConfig, src: str) -> None:
    """model.moe (its architecture's spec allows it): k of E experts per token; at least one layer a mixture of
    experts."""
    moe = m.moe
    if not moe.experts:
        return
    assert m.spec.experts, m.arch  # the spec's rules refuse experts where it has none
    if moe.top_k > moe.experts:
        raise invalid(src, "model.moe.top_k", moe.top_k, f"must be <= model.moe.experts={moe.experts}")
    if moe.dense_layers >= m.layers:
        raise invalid(src, "model.moe.dense_layers", moe.dense_layers,
                      f"leaves no mixture-of-experts layer; must be < model.layers={m.layers}")


def _check_paths(cfg: Config) -> None:
    """The files a run reads exist: the checkpoint to resume, the tokenizer, the HF weights, the data."""
    src, t = cfg.source, cfg.train
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


def _exists(src: str, key: str, path: str, test=Path.exists) -> bool:
    """``test(Path(path))``, where an OS error other than 'no such file' (a name past 255 bytes, a folder
    that may not be searched) is the key's error, not a traceback: pathlib raises those."""
    try:
        return test(Path(path))
    except OSError as e:
        raise invalid(src, key, path, f"cannot be checked ({e.strerror or e})") from None


def _check_tp(cfg: Config) -> None:
    """Tensor parallelism splits heads, the MLP, the vocabulary and (with SP) the sequence evenly."""
    m, tp, src = cfg.model, cfg.parallel.tp, cfg.source
    if m.heads % tp:
        raise invalid(src, "model.heads", m.heads, f"must be divisible by parallel.tp={tp} (whole heads per rank)")
    kv = m.kv_head_count
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise invalid(src, "model.kv_heads", kv, f"must be a multiple or a divisor of parallel.tp={tp} (whole k/v "
                      f"heads per rank, or each k/v head on tp/kv_heads ranks)")
    if kv < tp and m.head_width % (tp // kv):  # a checkpoint stores each replica's even share of the head
        raise invalid(src, "model.kv_heads", kv, f"puts each k/v head on {tp // kv} ranks (parallel.tp={tp}), which "
                      f"must divide the head dim {m.head_width}")
    ffn = arch.ffn_hidden(m)
    if ffn % tp:
        raise invalid(src, "model.ffn_hidden", ffn, f"must be divisible by parallel.tp={tp}")
    if m.padded_vocab % tp:
        raise invalid(src, "model.vocab_pad_multiple", m.vocab_pad_multiple,
                      f"pads model.vocab_size={m.vocab_size} to {m.padded_vocab}, which parallel.tp={tp} does not "
                      f"divide; use a multiple of {tp}, e.g. {128 * tp}")
    if cfg.parallel.sequence_parallel and (m.seq_len // cfg.parallel.cp) % tp:
        raise invalid(src, "model.seq_len", m.seq_len,
                      f"must be divisible by parallel.tp={tp}" + (f" times parallel.cp={cfg.parallel.cp}" if cfg.parallel.cp > 1
                                                                   else "") + " with parallel.sequence_parallel=true")
    if cfg.parallel.tp_overlap and cfg.train.micro_batch % 2:
        raise invalid(src, "train.micro_batch", cfg.train.micro_batch,
                      "must be even with parallel.tp_overlap=true (each microbatch runs as two halves)")
    _check_experts(cfg)
    check_context(cfg)


def _check_experts(cfg: Config) -> None:
    """Expert parallelism splits the experts evenly over ep ranks carved out of dp; each tp rank routes its own
    sequence shard, so the sequence splits over tp."""
    m, p, src = cfg.model, cfg.parallel, cfg.source
    moe = m.moe
    if p.ep > 1 and not moe.experts:
        raise invalid(src, "parallel.ep", p.ep, "splits experts, and model.moe.experts is 0; use 1")
    if not moe.experts:
        return
    if moe.experts % p.ep:
        raise invalid(src, "model.moe.experts", moe.experts, f"must be divisible by parallel.ep={p.ep} (whole "
                      "experts per rank)")
    if isinstance(p.dp, int) and p.dp % p.ep:
        raise invalid(src, "parallel.ep", p.ep, f"must divide parallel.dp={p.dp} (ep is carved out of dp)")
    if p.tp > 1 and (m.seq_len // p.cp) % p.tp:
        raise invalid(src, "model.seq_len", m.seq_len, f"must be divisible by parallel.tp={p.tp}: each tp rank "
                      "routes its own part of the sequence to the experts")
    width = arch.expert_hidden(m)
    shared = moe.shared_experts * width
    if moe.shared_experts and shared % p.tp:
        raise invalid(src, "model.moe.expert_hidden", width, f"times shared_experts="
                      f"{moe.shared_experts} ({shared}) must be divisible by parallel.tp={p.tp}: the shared experts "
                      "are one SwiGLU split over tp")
    if p.tp_overlap:
        raise invalid(src, "parallel.tp_overlap", True, "does not apply to mixture-of-experts layers (their "
                      "expert computation is not split over tp); use false")


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


def _check_compile(cfg: Config) -> None:
    """What train.compile cannot compose with (megazero.engine.compile_blocks), refused before a step."""
    if not cfg.train.compile:
        return
    if cfg.parallel.schedule == "zb1p":
        raise invalid(cfg.source, "train.compile", True,
                      "with parallel.schedule=zb1p: a compiled block's backward is one autograd node, which "
                      "zb1p cannot split into input and weight gradients (measured: wrong weight gradients); "
                      "use 1f1b or interleaved, or train.compile=false")
    if cfg.model.moe.experts:
        raise invalid(cfg.source, "train.compile", True,
                      f"with model.moe.experts={cfg.model.moe.experts}: the routed experts' grouped matmul "
                      "(torch._grouped_mm) does not trace in fp32, and their token counts change every step; "
                      "train.compile=false")


def _check_microbatches(cfg: Config, dp: int) -> None:
    """The schedule can be built (and listed, by the dry run) in seconds and fits the chunking."""
    p = cfg.parallel
    microbatches = cfg.train.global_batch // (cfg.train.micro_batch * dp)
    passes = microbatches * p.pp * p.virtual_stages
    if passes > _SCHEDULE_PASSES:
        raise invalid(cfg.source, "train.global_batch", cfg.train.global_batch,
                      f"gives {microbatches} microbatches per rank (global_batch / (micro_batch*dp)); times "
                      f"parallel.pp*virtual_stages={p.pp * p.virtual_stages} that is {passes} forward passes per "
                      f"step, above {_SCHEDULE_PASSES}; raise train.micro_batch or lower global_batch")
    problem = schedule_constraint(p.schedule, p.pp, microbatches, p.virtual_stages)
    if problem:  # the name and the chunking passed _check_pp: what is left is the microbatch count
        raise invalid(cfg.source, "train.global_batch", cfg.train.global_batch,
                      f"gives {microbatches} microbatches per rank (global_batch / (micro_batch*dp)); {problem}")


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


def world_dp(cfg: Config, world_size: int) -> int:
    """parallel.dp for this world size (auto: world / (tp*pp*cp)), checked: tp*pp*dp*cp covers the world exactly
    and the global batch splits into whole microbatches a schedule can run."""
    p = cfg.parallel
    src = cfg.source
    dp, inner = p.dp, p.tp * p.pp * p.cp
    names = "tp*pp*cp" if p.cp > 1 else "tp*pp"
    if dp == AUTO:
        if world_size % inner:
            if p.cp > 1 and world_size % p.cp:
                raise invalid(src, "parallel.cp", p.cp, f"must divide the world size {world_size}")
            raise invalid(src, f"parallel.{names}", inner,
                          f"must divide the world size {world_size} (parallel.dp=auto)")
        dp = world_size // inner
    if inner * dp != world_size:
        cp = f"*{p.cp}" if p.cp > 1 else ""
        raise UserError(f"{src}: parallel.{names}*dp = {p.tp}*{p.pp}{cp}*{dp} = {inner * dp} "
                        f"does not match the world size {world_size}; set parallel.dp=auto or launch "
                        f"{inner * dp} processes")
    if dp % p.ep:
        raise invalid(src, "parallel.ep", p.ep, f"must divide parallel.dp={dp} (ep is carved out of dp; world "
                      f"{world_size} = tp {p.tp} x pp {p.pp} x dp {dp}" + (f" x cp {p.cp})" if p.cp > 1 else ")"))
    _check_batch(cfg, dp)
    _check_microbatches(cfg, dp)
    return dp
