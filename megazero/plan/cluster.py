"""A described cluster: what the layout planner needs to know about the machines a run will get.

``configs/clusters/*.yaml`` hold one cluster each (GPUs per node, memory, peak,
HBM and link bandwidths, latencies). A cluster file is untrusted input like a
config: read by the same YAML loader (plain data only), every key from an
exact list, every value a positive finite number; a bad one is one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

from megazero.errors import UserError, invalid
from megazero.config.yaml_load import load_yaml, read_config_text

CLUSTER_DIR = Path(__file__).resolve().parents[2] / "configs" / "clusters"


@dataclass(frozen=True)
class Cluster:
    """Per GPU unless named otherwise; bandwidths per direction."""

    name: str
    gpus_per_node: int
    memory_gb: float
    peak_tflops: float  # dense bf16
    hbm_gbps: float
    intra_node_gbps: float  # NVLink/NVSwitch
    intra_node_latency_us: float
    inter_node_gbps: float  # InfiniBand, this GPU's share of the node's adapters
    inter_node_latency_us: float

    def link(self, crosses_nodes: bool) -> tuple[float, float]:
        """(bytes/s, seconds of latency) of a collective's slowest hop."""
        if crosses_nodes:
            return self.inter_node_gbps * 1e9, self.inter_node_latency_us * 1e-6
        return self.intra_node_gbps * 1e9, self.intra_node_latency_us * 1e-6


_KEYS = [f.name for f in fields(Cluster) if f.name != "name"]


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A cluster file, by path or by name under configs/clusters (``a100-80g``)."""
    path = Path(name_or_path)
    if not path.exists() and (CLUSTER_DIR / f"{name_or_path}.yaml").exists():
        path = CLUSTER_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml"))
        raise UserError(f"--cluster {name_or_path}: no such file; give a cluster .yaml or one of {', '.join(known)}")
    source = str(path)
    data = load_yaml(read_config_text(path), source)
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a mapping of {', '.join(_KEYS)}")
    for key in data:
        if key not in _KEYS:
            raise invalid(source, str(key), data[key], f"unknown key; valid: {', '.join(_KEYS)}")
    values = {}
    for key in _KEYS:
        if key not in data:
            raise UserError(f"{source}: {key} is missing; a cluster gives {', '.join(_KEYS)}")
        v = data[key]
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
        if key == "gpus_per_node":
            ok = ok and isinstance(v, int)
        if not ok:
            raise invalid(source, key, v, "expected a positive integer" if key == "gpus_per_node"
                          else "expected a finite number > 0")
        values[key] = v
    return Cluster(path.stem, **values)
