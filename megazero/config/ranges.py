"""Each key's allowed values: a choice list, a probability, or a range (_MIN, _MAX) with the reason for its
bound, and the one check that reads them (the config's rules, a checkpoint's stored model).

Every numeric key has a range that keeps what is computed from it downstream — torch sizes, numpy seeds,
int64 counts, schedule lengths — from overflowing or hanging; tests/config/test_config.py checks that none lacks one.
"""
from __future__ import annotations

from typing import Iterable, Optional

from megazero.config.schema import AUTO, Config
from megazero.errors import invalid
from megazero.models.registry import SPECS
from megazero.parallel.schedules import SCHEDULES
from megazero.parallel.zero.registry import OPTIMIZERS

# Allowed values and ranges, per key. A key absent here only needs the right type.
_CHOICES = {
    ("model", "arch"): tuple(SPECS),  # models.registry: one row per architecture
    ("model", "rope_scaling"): ("none", "llama3"),
    ("train", "precision"): ("fp32", "bf16", "fp16", "auto"),
    ("zero", "stage"): (0, 1, 2, 3),
    ("zero", "offload_optimizer"): ("none", "cpu", "nvme"),
    ("zero", "offload_params"): ("none", "cpu", "nvme"),
    ("zero", "grad_dtype"): ("auto", "fp32", "model"),
    ("kernels", "attention"): ("auto", "triton", "torch", "blocks"),
    ("train", "fp8"): ("none", "tensorwise", "rowwise"),
    ("log.wandb", "mode"): ("offline", "online"),
    ("kernels", "adam"): ("auto", "fused", "triton", "torch"),
    ("kernels", "norm"): ("auto", "triton", "torch"),
    ("launch", "device"): ("auto", "cpu", "cuda"),
    ("parallel", "schedule"): SCHEDULES,
    ("train", "on_nonfinite"): ("stop", "skip"),
    ("train", "on_spike"): ("none", "stop", "rollback"),
    ("train", "init_unused"): ("refuse", "drop"),
    ("train", "resume_changes"): ("warn", "allow"),
    ("model.moe", "router"): ("softmax", "sigmoid"),
    ("parallel", "cp_mode"): ("ring", "all_to_all"),
}
_MIN = {
    ("model", "layers"): 1, ("model", "hidden"): 1, ("model", "heads"): 1, ("model", "seq_len"): 1,
    ("model", "vocab_size"): 2, ("model", "ffn_hidden"): 1, ("model", "vocab_pad_multiple"): 1,
    ("model", "checkpoint_layers"): 0, ("model", "kv_heads"): 1, ("model", "head_dim"): 1, ("model", "norm_eps"): 1e-12,
    ("model", "rope_theta"): 1.0, ("model", "rope_factor"): 1.0, ("model", "rope_low_freq_factor"): 1e-6,
    ("model", "rope_high_freq_factor"): 1e-6, ("model", "rope_original_positions"): 1,
    ("parallel", "tp"): 1, ("parallel", "pp"): 1, ("parallel", "dp"): 1, ("parallel", "virtual_stages"): 1,
    ("train", "steps"): 1, ("train", "global_batch"): 1, ("train", "micro_batch"): 1,
    ("train", "lr"): 0.0, ("train", "min_lr"): 0.0, ("train", "warmup_steps"): 0,
    ("train", "weight_decay"): 0.0, ("train", "grad_clip"): 0.0, ("train", "seed"): 0,
    ("train", "eval_every"): 0, ("train", "eval_batches"): 1, ("train", "save_every"): 0,
    ("train", "keep_last"): 1, ("train", "exit_after"): 0, ("zero", "bucket_mb"): 0.001,
    ("zero", "nvme_buffer_mb"): 0.05,  # three slots of a 4 KiB page per state, at least
    ("train", "loss_chunk_tokens"): 0,
    ("parallel", "world_size"): 0, ("log", "every"): 1, ("model", "init_std"): 0.0,
    ("log", "peak_tflops"): 1e-9, ("train", "max_skipped"): 1,
    ("train", "spike_window"): 2, ("train", "spike_z"): 1e-9, ("train", "max_rollbacks"): 0,
    ("train", "straggler_ratio"): 1.0, ("train", "straggler_logs"): 1,  # a ratio of exactly 1: recovery_rules
    ("launch", "memory_gb"): 0.0, ("launch", "rank"): -1, ("launch", "cpu_threads"): 0,
    ("model.moe", "experts"): 0, ("model.moe", "top_k"): 1, ("model.moe", "expert_hidden"): 1,
    ("model.moe", "shared_experts"): 0, ("model.moe", "dense_layers"): 0, ("model.moe", "every"): 1,
    ("model.moe", "routed_scaling_factor"): 1e-6, ("model.moe", "bias_update_rate"): 0.0,
    ("model.moe", "aux_loss"): 0.0, ("model.moe", "z_loss"): 0.0, ("model.moe", "capacity_factor"): 0.0,
    ("parallel", "ep"): 1, ("parallel", "cp"): 1, ("data", "document_tokens"): 0,
    ("launch", "timeout_minutes"): 0.01,  # > 0: torch counts in milliseconds, so less would round to no wait
}

# Upper bounds, each with the reason: what downstream would overflow, hang or allocate without them.
# Shapes are bounded so that the largest tensor a rank builds, one microbatch's fp32 logits
# (micro_batch * seq_len * padded vocab = 2^16 * 2^20 * 2^24 elements), stays below int64 byte counts.
_STEPS = 2 ** 31 - 1  # step counts: int32, so any logger or tensor that keeps one holds it; 68 years at 1 s/step
MAX_WORLD = 2 ** 20  # ranks: as megazero.launch; the dry run lists every rank of every stage
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
    ("model", "head_dim"): 2 ** 16,  # 512 at most in published models; heads * head_dim * hidden stays < 2^52
    ("model", "norm_eps"): 1.0,  # added to a mean square; past 1 it outweighs unit-scale activations
    ("model", "rope_theta"): 1e12,  # Llama 3 uses 500,000; fp32 frequencies theta^(-2i/d) stay normal
    ("model", "rope_factor"): 1e6,  # Llama 3.1: 8; a context a million times the original is past any use
    ("model", "rope_low_freq_factor"): 1e6, ("model", "rope_high_freq_factor"): 1e6,  # Llama 3.1: 1 and 4
    ("model", "rope_original_positions"): 2 ** 20,  # as model.seq_len  # GPT-2 uses 0.02; a std past 10 only overflows 16-bit activations
    ("parallel", "tp"): MAX_WORLD, ("parallel", "pp"): MAX_WORLD, ("parallel", "dp"): MAX_WORLD,
    ("parallel", "world_size"): MAX_WORLD,
    ("parallel", "virtual_stages"): 4096,  # pp * virtual_stages <= model.layers
    ("train", "steps"): _STEPS, ("train", "warmup_steps"): _STEPS, ("train", "eval_every"): _STEPS,
    ("train", "save_every"): _STEPS, ("train", "exit_after"): _STEPS, ("train", "keep_last"): _STEPS,
    ("train", "max_skipped"): _STEPS, ("log", "every"): _STEPS, ("train", "max_rollbacks"): _STEPS,
    ("train", "spike_window"): 100_000,  # stored in each checkpoint's meta.json (checkpoint.meta.MAX_SPIKE_WINDOW)
    ("train", "spike_z"): 1e6,  # past this no finite loss noise is a spike
    ("train", "straggler_ratio"): 1e6, ("train", "straggler_logs"): _STEPS,
    ("train", "global_batch"): 2 ** 24,  # sequences per step: tokens per step (x seq_len) < 2^44
    ("train", "micro_batch"): 2 ** 16,  # sequences per forward; logits bound above
    ("train", "loss_chunk_tokens"): 2 ** 36,  # at most a microbatch's tokens (micro_batch x seq_len) matter
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
    ("zero", "nvme_buffer_mb"): 65536.0,  # as bucket_mb: host memory, 64 GiB
    ("log", "peak_tflops"): 1e6,  # per device; an H200 is ~1e3 dense bf16: MFU stays a readable number
    ("launch", "timeout_minutes"): 10080.0,  # a week; timedelta and NCCL's milliseconds hold it easily
    ("launch", "memory_gb"): 2.0 ** 40,  # a TB of TB; bytes stay exact in float64
    ("launch", "rank"): MAX_WORLD - 1,  # below the world size, checked once the world is known
    ("launch", "cpu_threads"): 2 ** 16,  # torch takes an int; no node has more cores
    ("data", "document_tokens"): 2 ** 20,  # as model.seq_len: a document past the sample changes nothing
    ("model.moe", "experts"): 2 ** 16,  # DeepSeek-V3: 256; per-expert counts and biases are E-long vectors
    ("model.moe", "top_k"): 2 ** 16,  # at most experts, checked by the rules
    ("model.moe", "expert_hidden"): 2 ** 20,  # as model.ffn_hidden
    ("model.moe", "shared_experts"): 2 ** 10,  # their SwiGLU is shared_experts*expert_hidden wide
    ("model.moe", "dense_layers"): 2 ** 31 - 1, ("model.moe", "every"): 2 ** 31 - 1,  # as model.layers
    ("model.moe", "routed_scaling_factor"): 1e6,  # DeepSeek-V3: 2.5; a scale this far out only overflows
    ("model.moe", "bias_update_rate"): 1.0,  # DeepSeek-V3: 0.001; the router's sigmoid scores are in (0, 1)
    ("model.moe", "aux_loss"): 1e6, ("model.moe", "z_loss"): 1e6,  # coefficients (~1e-2, ~1e-3 in use)
    ("model.moe", "capacity_factor"): 2 ** 16,  # past experts/top_k every expert takes every token anyway
    ("parallel", "ep"): MAX_WORLD, ("parallel", "cp"): MAX_WORLD,
}
_PROBABILITY = {("model", "dropout")}


def _tables() -> tuple[dict, dict, dict, set]:
    """The tables above with the optimizers' keys added from ``parallel.zero.registry`` as it is now: the valid
    names of optim.name, each section's (min, max) and probabilities (moment decays: 1 never moves)."""
    choices, low, high, probability = dict(_CHOICES), dict(_MIN), dict(_MAX), set(_PROBABILITY)
    choices[("optim", "name")] = tuple(OPTIMIZERS)
    choices[("optim", "switch_from")] = ("",) + tuple(n for n, row in OPTIMIZERS.items() if row.switches_to)
    for name, row in OPTIMIZERS.items():
        for key, (a, z) in getattr(row.section, "RANGES", {}).items():
            low[(f"optim.{name}", key)], high[(f"optim.{name}", key)] = a, z
        probability.update((f"optim.{name}", key) for key in getattr(row.section, "PROBABILITY", ()))
        choices.update({(f"optim.{name}", key): c for key, c in getattr(row.section, "CHOICES", {}).items()})
    return choices, low, high, probability


def _number(x) -> str:
    if isinstance(x, int) and x >= 2 ** 16 and (x & (x - 1) == 0 or (x + 1) & x == 0):
        return f"2^{x.bit_length() - (0 if (x + 1) & x == 0 else 1)}" + ("-1" if (x + 1) & x == 0 else "")
    return f"{x:g}" if isinstance(x, float) else str(x)


def allowed(section: str, key: str) -> Optional[str]:
    """The valid values of a key, in words, as the checks below apply them (the configuration reference's
    column); None where only the type is checked."""
    choices, lows, highs, probability = _tables()
    if (section, key) in choices:
        return " | ".join(f"`{c}`" for c in choices[(section, key)])
    if (section, key) in probability:
        return "0 ≤ x < 1"
    low, high = lows.get((section, key)), highs.get((section, key))
    if low is None and high is None:
        return None
    if high is None:
        return f"≥ {_number(low)}"
    return f"{_number(low)} … {_number(high)}" if low is not None else f"≤ {_number(high)}"


def choices(section: str, key: str) -> tuple:
    """The values a choice key allows (what a layout search may offer for it)."""
    return _tables()[0][(section, key)]


def check_ranges(cfg: Config, sections: Optional[Iterable[str]] = None, source: Optional[str] = None) -> None:
    """Every key of ``sections`` (default: all) within its range, probability or choice list; one line for the
    first that is not, from ``source`` (default: the config's file)."""
    src = cfg.source if source is None else source
    wanted = None if sections is None else set(sections)
    all_choices, lows, highs, probability = _tables()

    def holder(section: str):
        obj = cfg
        for part in section.split("."):  # model.moe: a mapping inside a section
            obj = getattr(obj, part, None)
        return obj

    def keys(table) -> list:  # a registry row added after the schema was made has no section here
        return [k for k in table if (wanted is None or k[0].split(".")[0] in wanted) and holder(k[0]) is not None]

    def value(section: str, key: str):
        return getattr(holder(section), key)

    for section, key in keys(lows) + [k for k in keys(highs) if k not in lows]:
        v = value(section, key)
        if v is None or v == AUTO:
            continue
        low, high = lows.get((section, key)), highs.get((section, key))
        if (low is not None and v < low) or (high is not None and v > high):
            valid = " and ".join(f"{op} {bound}" for op, bound in ((">=", low), ("<=", high)) if bound is not None)
            raise invalid(src, f"{section}.{key}", v, f"must be {valid}")
    for section, key in keys(probability):
        v = value(section, key)
        if not 0.0 <= v < 1.0:
            raise invalid(src, f"{section}.{key}", v, "must be in [0, 1)")
    for (section, key), choices in ((k, all_choices[k]) for k in keys(all_choices)):
        v = value(section, key)
        if v not in choices:
            raise invalid(src, f"{section}.{key}", v, f"valid: {' | '.join(str(c) for c in choices)}")
