"""A described cluster: what the layout planner needs to know about the machines a run will get.

``configs/clusters/*.yaml`` hold one cluster each (GPUs per node, memory, peak,
HBM and link bandwidths, latencies). A cluster file is untrusted input like a
config: read by the same YAML loader (plain data only), every key from an
exact list, every value a number (not a boolean, not nan or inf) within its
key's range (_RANGES); a bad one is one line naming the file, the key, the
value and the range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

from megazero.errors import UserError, invalid, shown_name
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
# Each key's range, with the reason for its bounds: wide around every GPU and fabric built or announced, and
# narrow enough that the step-time model's products and quotients of them (a peak over a bandwidth, bytes over
# a bandwidth, a latency times a hop count) stay finite and nonzero in floating point.
_RANGES = {
    # GPUs on one NVLink domain, the search's largest tp: 8 in a DGX, 72 in an NVL72 rack, 576 announced
    "gpus_per_node": (1, 4096),
    # GB of HBM per GPU: 16 to 192 today, 100 TB past any package; down to 1 MB, where a test's tiny config
    # (a plan of ~10 MB) fits only some of its layouts
    "memory_gb": (0.001, 1e5),
    # dense 16-bit TFLOP/s per GPU: a CPU core's ~0.1 to 40 times a B200's 2,250
    "peak_tflops": (0.1, 1e5),
    # GB/s per GPU, per direction: HBM (an H200's 4,800), NVLink (900 at NVLink 5), InfiniBand (an 800 Gb/s
    # adapter's 100); from 10 MB/s, a slow disk, to a PB/s, a thousand times any link
    "hbm_gbps": (0.01, 1e6),
    "intra_node_gbps": (0.01, 1e6),
    "inter_node_gbps": (0.01, 1e6),
    # microseconds per hop: a nanosecond (a metre of cable takes ~5) to a second, beyond any fabric
    "intra_node_latency_us": (0.001, 1e6),
    "inter_node_latency_us": (0.001, 1e6),
}
assert set(_RANGES) == set(_KEYS)


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A cluster file, by path or by name under configs/clusters (``a100-80g``)."""
    path = Path(name_or_path)
    if not _is_file(path) and _is_file(CLUSTER_DIR / f"{name_or_path}.yaml"):
        path = CLUSTER_DIR / f"{name_or_path}.yaml"
    if not _is_file(path):
        known = sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml"))
        raise UserError(f"--cluster {shown_name(str(name_or_path))}: no such file; give a cluster .yaml or one of "
                        f"{', '.join(known)}")
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
        values[key] = _checked(source, key, data[key])
    return Cluster(path.stem, **values)


def _is_file(path: Path) -> bool:
    """A regular file there; a name the system cannot look up (too long, a NUL byte) is none."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _checked(source: str, key: str, v: object) -> float:
    """``v`` when it is a number (an integer for gpus_per_node) within the key's range, else one line."""
    low, high = _RANGES[key]
    integer = key == "gpus_per_node"
    kind = "an integer" if integer else "a number"
    number = isinstance(v, int) or (isinstance(v, float) and not integer and math.isfinite(v))
    if isinstance(v, bool) or not number or not low <= v <= high:  # an int of any size compares exactly
        raise invalid(source, key, v, f"expected {kind} from {low:g} to {high:g}")
    return v
