"""The rules of a run's own watch and recovery: what a rollback needs kept on disk (``train.on_spike``), what
names a straggler (``train.straggler_ratio``), and what says a restarted run has finished (``train.save_at_end``)."""
from __future__ import annotations

from megazero.config.schema import Config
from megazero.errors import invalid


def check_recovery(cfg: Config) -> None:
    """A rollback goes to a checkpoint at or before step spike - spike_window: of the keep_last saves every
    save_every steps, the oldest is at least (keep_last - 1) x save_every steps back, so that must reach it."""
    t = cfg.train
    if t.straggler_ratio <= 1.0:
        raise invalid(cfg.source, "train.straggler_ratio", t.straggler_ratio, "must be > 1 (a rank's compute time "
                      "over the ranks' median: every rank is at 1 or below it, or above it)")
    if not t.save_at_end and t.resume == "auto" and not t.exit_after:
        raise invalid(cfg.source, "train.save_at_end", "false",
                      "leaves no checkpoint of the finished run, so train.resume=auto would train its last steps "
                      "again on a restart; keep it true, or set train.exit_after (whose jobs each save)")
    if t.on_spike != "rollback":
        return
    reach = (t.keep_last - 1) * t.save_every
    if reach < t.spike_window:
        raise invalid(cfg.source, "train.on_spike", t.on_spike,
                      f"rolls back to a checkpoint at least train.spike_window={t.spike_window} steps before the "
                      f"spike, but (train.keep_last - 1) x train.save_every = ({t.keep_last} - 1) x {t.save_every} "
                      f"= {reach} steps back is the oldest kept; raise train.keep_last or train.save_every, or "
                      f"lower train.spike_window")
