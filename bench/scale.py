"""Full-size simulations (``pretrain.py --simulate``) of the layouts published runs used, on this one CPU.

    python bench/scale.py [--only gpt13b_64,...] [--stages 1,2,3] [--all-stages] [--json out.json]

Each case runs two real training steps of the ranks that can bind, on fake tensors and the fake process
group, and prints one markdown row per rank beside the --dry-run plan, with the time it took. Which ranks
can bind: every stage holds the same model state except the first (embeddings) and the last (the head, its
logits); under 1F1B and the interleaved schedule stage r holds at most pp - r microbatches (Narayanan et
al. 2021), so among the middle stages the second holds the most activations and bounds the others. So
stages 0, 1 and pp - 1 are simulated (``--all-stages``: every one, as ``pretrain.py --simulate`` does).
Then the per-layer activation bytes of each model against Korthikanti et al. 2022 (§4, Table 2).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GB = 1e9
GPT3_175B = ["model.layers=96", "model.hidden=12288", "model.heads=96", "model.seq_len=2048",
             "model.vocab_size=51200", "model.activation_checkpointing=true", "model.dropout=0.1",
             "train.global_batch=1536", "train.micro_batch=1", "train.precision=bf16",
             "parallel.tp=8", "parallel.sequence_parallel=true", "parallel.pp=16", "parallel.dp=8"]
ONE_T = ["model.layers=128", "model.hidden=25600", "model.heads=160", "model.seq_len=2048",
         "model.vocab_size=51200", "model.activation_checkpointing=true", "model.dropout=0.1",
         "train.global_batch=3072", "train.micro_batch=1", "train.precision=bf16",
         "parallel.tp=8", "parallel.sequence_parallel=true", "parallel.pp=64", "parallel.dp=6"]
# name -> (config file, overrides): Brown et al. 2020 (GPT-3 13B, 175B), Narayanan et al. 2021 Table 1 (1T)
CASES = {
    "gpt13b_64": ("configs/gpt13b.yaml", []),
    "gpt13b_512": ("configs/gpt13b.yaml", ["parallel.dp=64"]),
    "gpt3_175b_1f1b": (None, GPT3_175B + ["parallel.schedule=1f1b"]),
    "gpt3_175b_interleaved": (None, GPT3_175B + ["parallel.schedule=interleaved", "parallel.virtual_stages=2"]),
    "1t": (None, ONE_T + ["parallel.schedule=1f1b"]),
}
OFFLOADED = {"gpt13b_64", "gpt3_175b_1f1b"}  # also run once with the optimizer offloaded (ZeRO-2)


def binding_ranks(cfg, every: bool) -> list[int]:
    from megazero.parallel.topology import coords_to_rank

    p = cfg.parallel
    stages = range(p.pp) if every else sorted({0, min(1, p.pp - 1), p.pp - 1})
    return [coords_to_rank(s, 0, 0, p.tp, p.dp, 0, p.cp) for s in stages]


def run_case(name: str, path, overrides: list[str], every: bool) -> list[dict]:
    from megazero.config.load import load_config
    from megazero.config.resolve import resolve
    from megazero.plan.stage_plan import make_plan
    from megazero.plan.simulate import simulate_rank

    cfg = load_config(path, overrides)
    p = cfg.parallel
    resolve(cfg, p.tp * p.pp * p.dp, "cpu")  # the simulation runs the CPU code path
    plan = make_plan(cfg)
    rows = []
    for rank in binding_ranks(cfg, every):
        r = simulate_rank(copy.deepcopy(cfg), rank, plan)
        row = {"case": name, "stage": cfg.zero.stage, "offload": cfg.zero.offload_optimizer,
               "world": p.tp * p.pp * p.dp, "microbatches": cfg.microbatches, "rank": r.rank, "pp_rank": r.pp_rank,
               "peak_gb": r.peak_bytes / GB, "plan_gb": r.plan_bytes["total"] / GB,
               **{f"{k}_gb": v / GB for k, v in r.bytes.items()}, "host_gb": r.host_bytes / GB, "build_gb": r.build_peak_bytes / GB,
               "plan_host_gb": r.plan_bytes["host"] / GB, "moment": r.moment, "seconds": r.seconds,
               "sent_gb": {g: b / GB for g, b in r.comm_bytes.items()}}
        rows.append(row)
        print(f"| {name} | {row['stage']}{' +offload' if row['offload'] == 'cpu' else ''} | {row['pp_rank']} | "
              f"{row['peak_gb']:.1f} | {row['plan_gb']:.1f} | {row['peak_gb'] / row['plan_gb']:.2f} | "
              f"{row['params_gb']:.1f} | {row['grads_gb']:.1f} | {row['optimizer_gb']:.1f} | "
              f"{row['activations_gb']:.2f} | {row['comm_gb']:.2f} | {row['temporaries_gb']:.2f} | "
              f"{row['host_gb']:.1f} | {row['build_gb']:.1f} | {row['moment']} | {row['seconds']:.0f} |", flush=True)
    return rows


def layer_rows(only: set) -> list[dict]:
    """Per-layer activation bytes at the full sizes, against 34·sbh/t (dropout), 32 (none), 2 (checkpointed)."""
    from megazero.config.load import load_config
    from megazero.config.resolve import resolve
    from megazero.plan.simulate import layer_activation_bytes

    out = []
    for name, (path, overrides) in CASES.items():
        if name not in only or name.endswith("interleaved") or name == "gpt13b_512":
            continue
        for dropout, ckpt, paper in ((0.1, False, 34), (0.0, False, 32), (0.1, True, 2)):
            cfg = load_config(path, overrides + [f"model.dropout={dropout}",
                                                 f"model.activation_checkpointing={str(ckpt).lower()}",
                                                 "parallel.sequence_parallel=true"])
            p = cfg.parallel
            resolve(cfg, p.tp * p.pp * p.dp, "cpu")
            got = layer_activation_bytes(cfg)
            sbh_t = cfg.model.seq_len * cfg.train.micro_batch * cfg.model.hidden / p.tp
            out.append({"case": name, "dropout": dropout, "checkpointed": ckpt, "bytes": got,
                        "per_sbh_t": got / sbh_t, "paper": paper})
            print(f"| {name} | {dropout} | {'yes' if ckpt else 'no'} | {got / 2 ** 20:,.1f} | "
                  f"{got / sbh_t:.2f} | {paper} | {got / sbh_t / paper:.3f} |", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(CASES), help="comma-separated cases: " + ", ".join(CASES))
    ap.add_argument("--stages", default="1,2,3", help="ZeRO stages to simulate")
    ap.add_argument("--all-stages", action="store_true", help="every pipeline stage, not only those that bind")
    ap.add_argument("--no-layers", action="store_true", help="skip the per-layer activation table")
    ap.add_argument("--json", help="write every row here")
    args = ap.parse_args()
    only = set(args.only.split(","))
    unknown = only - set(CASES)
    if unknown:
        ap.error(f"--only: unknown case(s) {', '.join(sorted(unknown))}; valid: {', '.join(CASES)}")
    stages = [int(s) for s in args.stages.split(",") if s]  # "": only the offloaded runs
    rows: list[dict] = []
    print("| case | ZeRO | pp stage | peak GB | plan GB | sim/plan | params | grads | optimizer | activations | "
          "comm | temporaries | host | build peak | peak at | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    start = time.perf_counter()
    for name, (path, overrides) in CASES.items():
        if name not in only:
            continue
        case_start = time.perf_counter()
        for stage in stages:
            rows += run_case(name, path, overrides + [f"zero.stage={stage}"], args.all_stages)
        if name in OFFLOADED:
            rows += run_case(name, path, overrides + ["zero.stage=2", "zero.offload_optimizer=cpu"],
                             args.all_stages)
        print(f"<!-- {name}: {time.perf_counter() - case_start:.0f} s -->", flush=True)
    layers = []
    if not args.no_layers:
        print("\n| model | dropout | checkpointed | MiB per layer | x sbh/t | paper | ratio |\n|---|---|---|---|---|---|---|")
        layers = layer_rows(only)
    print(f"\ntotal {time.perf_counter() - start:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "layers": layers}, indent=1))


if __name__ == "__main__":
    main()
