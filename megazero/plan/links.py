"""What moving bytes between ranks costs on a described cluster: the link a group of ranks gets from its
placement, a ring collective over it, an all-to-all over it (megazero.plan.step_time and
megazero.plan.context read these; docs/planner.md, "Placement").

Rank order is (pp, dp, cp, tp), tp fastest (parallel.topology): a group of ``size`` ranks ``stride`` apart is
inside a node when it fits in one (NVLink); across nodes every GPU has its own adapter, so a group with g
members per node drives g adapters at once (NCCL's rail-aligned rings).
"""
from __future__ import annotations

from typing import Protocol

from megazero.plan.cluster import Cluster


class Efficiency(Protocol):
    """What a cost here needs of the step-time model's constants (megazero.plan.step_time.Constants)."""

    comm_eff: float  # the share of a link's bandwidth a collective (or a p2p transfer) achieves


def group_link(cluster: Cluster, size: int, stride: int) -> tuple[float, float]:
    """(bytes/s per GPU, latency) of a collective over ``size`` ranks ``stride`` apart in rank order.

    Inside a node: NVLink. Across nodes: every GPU has its own adapter, so a group with g members per node
    drives g adapters at once (NCCL's rail-aligned rings): g * inter_node, at most the NVLink speed."""
    node = cluster.gpus_per_node
    per_node = max(1, min(size, node // stride)) if stride < node else 1
    if size <= per_node and (stride * (size - 1)) < node:
        return cluster.link(False)
    bandwidth, latency = cluster.link(True)
    return min(per_node * bandwidth, cluster.intra_node_gbps * 1e9), latency


def nested_link(cluster: Cluster, inner: int, inner_stride: int, outer: int, outer_stride: int) -> tuple[float, float]:
    """:func:`group_link` of a group over two grid dimensions: ``inner`` ranks ``inner_stride`` apart, repeated
    ``outer`` times ``outer_stride`` apart (an expert's edp x cp: cp ranks tp apart, edp ranks tp * cp * ep
    apart). At outer = 1 or inner = 1 it is group_link of the other."""
    if outer == 1:
        return group_link(cluster, inner, inner_stride)
    if inner == 1:
        return group_link(cluster, outer, outer_stride)
    node = cluster.gpus_per_node
    per_inner = max(1, min(inner, node // inner_stride)) if inner_stride < node else 1
    outer_on_node = max(1, min(outer, node // outer_stride)) if outer_stride < node else 1
    per_node = per_inner * (outer_on_node if inner_stride * inner <= node else 1)
    if outer_stride * (outer - 1) + inner_stride * (inner - 1) < node:
        return cluster.link(False)
    bandwidth, latency = cluster.link(True)
    return min(per_node * bandwidth, cluster.intra_node_gbps * 1e9), latency


def all_to_all(cluster: Cluster, sent: float, calls: float, size: int, stride: int, c: Efficiency) -> float:
    """``calls`` all-to-alls over ``size`` ranks ``stride`` apart that send ``sent`` bytes to the other ranks in
    all: each rank sends an equal share to every peer, those on its node over NVLink and the rest through its
    own adapter at the same time, so the slower of the two paths sets the time; plus each call's hops."""
    if size <= 1 or not sent:
        return 0.0
    node = cluster.gpus_per_node
    local = max(1, min(size, node // stride)) if stride < node else 1  # ranks of the group on one node
    intra_bw, intra_lat = cluster.link(False)
    inter_bw, inter_lat = cluster.link(True)
    on_node = sent * (local - 1) / (size - 1)
    off_node = sent - on_node
    seconds = max(on_node / intra_bw, off_node / inter_bw) / c.comm_eff
    return seconds + calls * (size - 1) * (inter_lat if off_node else intra_lat)


def ring(nbytes: float, n: int, link: tuple[float, float], c: Efficiency, passes: float = 2.0) -> float:
    """A ring collective over n ranks: passes*(n-1)/n of the bytes at the link's achieved bandwidth, plus its
    hops' latency (all-reduce: 2 passes; all-gather or reduce-scatter: 1)."""
    if n <= 1:
        return 0.0
    bandwidth, latency = link
    return passes * (n - 1) / n * nbytes / (bandwidth * c.comm_eff) + passes * (n - 1) * latency
