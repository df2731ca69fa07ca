"""What a resume keeps for 1-bit Adam (``parallel.zero.onebit_adam``): past its warm-up each rank holds
error-feedback buffers that belong to its place in the layout, and the frozen variance was bias-corrected by the
warm-up's length; a checkpoint from there resumes at its own layout and warm-up only, refused in one line
otherwise. Within the warm-up the states are AdamW's and any layout may resume them."""
from __future__ import annotations

from pathlib import Path

from megazero.checkpoint.meta import short
from megazero.config.moved import sections_of
from megazero.config.schema import Config
from megazero.errors import UserError

# what places a rank's 1-bit Adam error buffers: their length (the buckets) and whose momentum they compress
_ONEBIT_LAYOUT = (("parallel", "tp"), ("parallel", "pp"), ("parallel", "dp"), ("parallel", "cp"), ("parallel", "ep"),
                  ("parallel", "virtual_stages"), ("parallel", "pp_layers"), ("parallel", "world_size"),
                  ("zero", "stage"), ("zero", "bucket_mb"), ("zero", "grad_dtype"), ("train", "precision"))


def check_onebit_layout(path: Path, meta: dict, cfg: Config) -> None:
    """1-bit Adam past its warm-up holds error-feedback buffers per rank: a resume from there keeps the layout
    and the warm-up's length (the frozen variance's bias correction). A checkpoint of the warm-up's last step
    (``optimizer_step == freeze_step``) is still AdamW's: it resumes at any layout, and with a longer warm-up."""
    config, step = meta.get("config", {}), meta.get("optimizer_step", 0)
    # a checkpoint written with the flat keys (optim.freeze_step, ...) has them read as optim.onebit_adam's
    stored = sections_of(config["optim"]) if isinstance(config.get("optim"), dict) else {}
    optim = stored.get("onebit_adam") if isinstance(stored.get("onebit_adam"), dict) else {}
    mine = cfg.optim.onebit_adam
    theirs = optim.get("freeze_step", mine.freeze_step)
    # up to the shorter warm-up's last step both runs took AdamW's steps alike; past it one of them compresses
    if not isinstance(theirs, int) or isinstance(theirs, bool) or \
            (step > min(theirs, mine.freeze_step) and theirs != mine.freeze_step):
        raise UserError(f"checkpoint {path}: optim.onebit_adam.freeze_step is {short(theirs)} there and "
                        f"{mine.freeze_step} here, at optimizer step {step}; a resume past the warm-up "
                        f"keeps its length, which the frozen variance was bias-corrected by")
    if step <= theirs:  # no compressed step has run: the states are AdamW's, the error buffers not yet made
        return
    for key in ("beta2", "eps"):  # the frozen variance's bias correction, and which elements are compressed
        if key in optim and optim[key] != getattr(mine, key):
            raise UserError(f"checkpoint {path}: optim.onebit_adam.{key} is {short(optim[key])} there and "
                            f"{getattr(mine, key)!r} here, past 1-bit Adam's warm-up (optimizer step {step} > "
                            f"optim.onebit_adam.freeze_step={theirs}); the frozen variance was bias-corrected by "
                            f"beta2 and the elements compressed chosen by eps: a resume keeps both")
    changed = _layout_changes(config, cfg)
    if changed:
        raise UserError(f"checkpoint {path}: {', '.join(changed)}; a 1-bit Adam run past its warm-up (optimizer "
                        f"step {step} > optim.onebit_adam.freeze_step={theirs}) resumes at its own layout only, since its "
                        f"error-feedback buffers are per rank")


def _layout_changes(config: dict, cfg: Config) -> list[str]:
    """The keys that place a rank's error buffers, as "<key> is <there> there and <here> here"."""
    here = cfg.to_dict()
    changed = []
    for section, key in _ONEBIT_LAYOUT:
        there_s, here_s = config.get(section), here.get(section, {})
        if isinstance(there_s, dict) and key in there_s and there_s[key] != here_s.get(key):
            changed.append(f"{section}.{key} is {short(there_s[key])} there and {here_s.get(key)!r} here")
    return changed


def _stored(config: dict, name: str) -> dict:
    """The checkpoint's ``optim.<name>`` section ({} where it has none; flat keys read as the section's)."""
    stored = sections_of(config["optim"]) if isinstance(config.get("optim"), dict) else {}
    return stored.get(name) if isinstance(stored.get(name), dict) else {}


def _refuse_changed(path: Path, name: str, theirs: dict, mine: object, keys: tuple[str, ...], why: str) -> None:
    """One line naming the first of ``keys`` whose value differs between the checkpoint's section and ours."""
    for key in keys:
        if key in theirs and theirs[key] != getattr(mine, key):
            raise UserError(f"checkpoint {path}: optim.{name}.{key} is {short(theirs[key])} there and "
                            f"{getattr(mine, key)!r} here, {why}")


def check_zero_one_layout(path: Path, meta: dict, cfg: Config) -> None:
    """0/1 Adam holds per-rank state from its first compressed step (the error feedback; past the freeze the
    rank's own momentum and accumulator too): a checkpoint from there resumes at its own layout and with its own
    policies only. Before it the states are AdamW-shaped and layout-free."""
    from megazero.parallel.zero.zero_one_policy import updates_variance

    config, step = meta.get("config", {}), meta.get("optimizer_step", 0)
    optim, mine = _stored(config, "zero_one_adam"), cfg.optim.zero_one_adam
    freeze = optim.get("var_freeze_step", mine.var_freeze_step)
    kappa = optim.get("var_update_scaler", mine.var_update_scaler)

    def exact_so_far(freeze: object, kappa: object) -> bool:
        return isinstance(freeze, int) and isinstance(kappa, int) and \
            all(updates_variance(t, freeze, kappa) for t in range(1, min(step, kappa + 2) + 1))

    if exact_so_far(freeze, kappa) and exact_so_far(mine.var_freeze_step, mine.var_update_scaler):
        return  # only full-precision steps so far, under both runs' policies
    _refuse_changed(path, "zero_one_adam", optim, mine, ("beta2", "eps", "var_freeze_step", "var_update_scaler",
                                                         "local_step_scaler", "local_step_clipper",
                                                         "local_step_policy"),
                    f"at optimizer step {step}, by which one of the runs compressed a step; a resume keeps the "
                    f"variance's and the synchronisations' policies")
    changed = _layout_changes(config, cfg)
    if changed:
        raise UserError(f"checkpoint {path}: {', '.join(changed)}; a 0/1 Adam run past its first compressed step "
                        f"(optimizer step {step}) resumes at its own layout only, since its error-feedback buffers, "
                        f"momenta and accumulators are per rank")


def check_onebit_lamb_layout(path: Path, meta: dict, cfg: Config) -> None:
    """1-bit LAMB keeps per-layer figures per rank from its first step (the warm-up's trust-ratio averages), and
    past the warm-up the error feedback and the fresh variance: a resume keeps the layout, the warm-up's length,
    beta2 and eps."""
    config, step = meta.get("config", {}), meta.get("optimizer_step", 0)
    if step < 1:
        return
    _refuse_changed(path, "onebit_lamb", _stored(config, "onebit_lamb"), cfg.optim.onebit_lamb,
                    ("freeze_step", "beta2", "eps"), f"at optimizer step {step}; a 1-bit LAMB resume keeps the "
                    f"warm-up's length and the variance's settings")
    changed = _layout_changes(config, cfg)
    if changed:
        raise UserError(f"checkpoint {path}: {', '.join(changed)}; a 1-bit LAMB run (optimizer step {step}) resumes "
                        f"at its own layout only, since its per-layer figures, error-feedback buffers and fresh "
                        f"variance are per rank")


def check_rank_state_stored(path: Path, wanted: list[str], stored: set[str]) -> None:
    """A checkpoint past 1-bit Adam's warm-up holds each rank's error feedback (``rank/<global rank>/...``); one
    written before megazero saved it has none, and resuming it would restart the errors at zero unsaid. The
    same verdict on every rank (none holds any), before any collective."""
    if wanted and not any(k.startswith("rank/") for k in stored):
        raise UserError(f"checkpoint {path}: holds no per-rank optimizer state ({wanted[0]!r} and the like: 1-bit "
                        f"Adam's error feedback past optim.onebit_adam.freeze_step), written before megazero saved it; resume "
                        f"from a checkpoint within the warm-up, or start afresh")
