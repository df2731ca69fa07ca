"""Pretrain a GPT: `python pretrain.py --config configs/tiny.yaml [--set section.key=value ...]
[--dry-run | --simulate [full]]`.

Runs as a plain process (world size 1), under torchrun, or under Slurm's srun. Exit codes: 0 done, 2 an input
error, 3 non-finite loss or gradients, 4 a collective timed out, 128+N stopped by signal N after saving
(megazero/errors.py).
"""
from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="megazero: pretrain a GPT with 3D parallelism")
    ap.add_argument("--config", required=True, help="YAML run description, e.g. configs/tiny.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config value (repeatable)")
    ap.add_argument("--dry-run", action="store_true",
                    help="validate the config and print each rank's parameters, memory and FLOPs; "
                         "allocates nothing, starts no process group (plan another size with "
                         "--set parallel.world_size=N)")
    ap.add_argument("--simulate", nargs="?", const="auto", choices=("auto", "full"),
                    help="run one rank of each pipeline stage through two real training steps at full size on "
                         "fake tensors and a fake process group, in this process; print each one's peak memory "
                         "by category beside the plan and write simulate.json to log.dir; exit 3 when one does "
                         "not fit in launch.memory_gb. Extrapolated from steps with fewer layers and "
                         "microbatches where the increments are constant; '--simulate full' runs every one")
    args = ap.parse_args(argv)
    if args.dry_run and args.simulate:
        ap.error("--dry-run and --simulate are two different answers; choose one")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from megazero.train.run import cli

    return cli(args.config, args.set, args.dry_run, args.simulate)


if __name__ == "__main__":
    sys.exit(main())
