"""Pretrain a GPT: `python pretrain.py --config configs/tiny.yaml [--set section.key=value ...] [--dry-run]`.

Runs as a plain process (world size 1), under torchrun, or under Slurm's srun.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

from megazero.errors import UserError


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="megazero: pretrain a GPT with 3D parallelism")
    ap.add_argument("--config", required=True, help="YAML run description, e.g. configs/tiny.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config value (repeatable)")
    ap.add_argument("--dry-run", action="store_true",
                    help="validate the config and print each rank's parameters, memory and FLOPs; "
                         "allocates nothing, starts no process group (plan another size with "
                         "--set parallel.world_size=N)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from megazero.run import dry_run, run

    try:
        (dry_run if args.dry_run else run)(args.config, args.set)
    except UserError as e:
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        elif local_rank == 0:  # another node's first process: an input only that node lacks (a node-local path)
            print(f"error (rank {rank}, {socket.gethostname()}): {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
