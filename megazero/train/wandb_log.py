"""``log.wandb``: the run's scalars and resolved config to Weights & Biases, beside TensorBoard.

The writing rank opens one W&B run; its id is kept in ``log.dir/wandb_run_id``, so a resume (a restart, a
later ``train.resume``) continues the same run, and a fresh run in the folder starts a new one. ``offline``
writes W&B's own files under ``log.dir/wandb`` (``wandb sync`` uploads them later) and needs no network.
Nothing of wandb is imported unless ``log.wandb.project`` is set; a missing package is one line naming the
extra that installs it. wandb itself keeps its service's debug logs under ``~/.cache/wandb``.

``run.finish()`` returns once W&B has the run's exit; its service closes the run's files afterwards, on its
own time. ``finish`` therefore also tears the service down (what W&B's exit hook does), so the files are whole
when megazero's run returns and a resume in the same process does not meet the old run's closing stream.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from megazero.errors import UserError

ID_FILE = "wandb_run_id"


class WandbRun:
    """One W&B run for a megazero run: ``log(step, scalars)`` per logged step, ``finish()`` at the end."""

    def __init__(self, cfg: Any, resumed: bool):
        try:
            import wandb
        except ImportError:
            raise UserError(f"{cfg.source}: log.wandb.project={cfg.log.wandb.project!r} needs the wandb package; "
                            "install it with pip install 'megazero[wandb]', or set log.wandb.project=''") from None
        w, folder = cfg.log.wandb, Path(cfg.log.dir)
        id_file = folder / ID_FILE
        run_id = id_file.read_text().strip() if resumed and id_file.is_file() else None  # None: W&B makes one
        self.run = wandb.init(project=w.project, name=w.name or cfg.name, mode=w.mode, dir=str(folder),
                              id=run_id, resume="allow" if run_id else None, config=dataclasses.asdict(cfg),
                              settings=wandb.Settings(silent=True))  # the console is megazero's
        id_file.write_text(self.run.id + "\n")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def finish(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # waits for the service to close the run's files
