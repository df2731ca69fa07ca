"""Rank math of the (pp, dp, cp, tp) grid, without processes, and the mesh it builds with processes."""
import itertools

import pytest

from megazero.parallel.topology import Grid, coords_to_rank, group_ranks, rank_to_coords


def factorisations(n):
    for tp in range(1, n + 1):
        for pp in range(1, n + 1):
            for cp in range(1, n + 1):
                if n % (tp * pp * cp) == 0:
                    yield tp, pp, n // (tp * pp * cp), cp


SHAPES = [s for n in (1, 2, 4, 6, 8, 12, 16) for s in factorisations(n)] + [(2, 4, 8, 1), (8, 1, 2, 4)]


@pytest.mark.parametrize("tp,pp,dp,cp", SHAPES)
def test_rank_math_is_a_bijection_with_tp_fastest(tp, pp, dp, cp):
    world = tp * pp * dp * cp
    # Independent enumeration in Megatron order: pp slowest, then dp, then cp, then tp.
    expected = list(itertools.product(range(pp), range(dp), range(cp), range(tp)))
    assert [rank_to_coords(r, tp, pp, dp, cp) for r in range(world)] == expected
    for r in range(world):
        p, d, c, t = rank_to_coords(r, tp, pp, dp, cp)
        assert coords_to_rank(p, d, t, tp=tp, dp=dp, cp_rank=c, cp=cp) == r


@pytest.mark.parametrize("tp,pp,dp,cp", SHAPES)
def test_groups_partition_the_world(tp, pp, dp, cp):
    world = tp * pp * dp * cp
    for dim, size in (("tp", tp), ("dp", dp), ("pp", pp), ("cp", cp)):
        groups = group_ranks(dim, tp, pp, dp, cp)
        assert len(groups) == world // size
        assert sorted(r for g in groups for r in g) == list(range(world))
        for g in groups:
            assert len(g) == size
            coords = [rank_to_coords(r, tp, pp, dp, cp) for r in g]
            # every coordinate but the group's own is shared inside a group
            keep = [i for i, d in enumerate(("pp", "dp", "cp", "tp")) if d != dim]
            assert len({tuple(c[i] for i in keep) for c in coords}) == 1
    if tp > 1:  # tp groups are contiguous ranks (one node)
        assert all(g == list(range(g[0], g[0] + tp)) for g in group_ranks("tp", tp, pp, dp, cp))
    if cp > 1:  # a cp group's ranks sit tp apart, inside one block of tp*cp consecutive ranks
        assert all(g[-1] - g[0] == (cp - 1) * tp for g in group_ranks("cp", tp, pp, dp, cp))


@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 2), (1, 4, 2), (4, 1, 1)])
def test_neighbours_and_stage_flags(tp, pp, dp):
    for r in range(tp * pp * dp):
        g = Grid(tp=tp, pp=pp, dp=dp, rank=r)
        p, d, c, t = g.coords
        assert g.is_first_stage == (p == 0) and g.is_last_stage == (p == pp - 1)
        if p > 0:
            assert rank_to_coords(g.prev_stage_rank, tp, pp, dp) == (p - 1, d, c, t)
        else:
            assert g.prev_stage_rank is None
        if p < pp - 1:
            assert rank_to_coords(g.next_stage_rank, tp, pp, dp) == (p + 1, d, c, t)
        else:
            assert g.next_stage_rank is None
        assert f"pp={pp} x dp={dp} x tp={tp}" in str(g)


def _mesh_groups(rank, world, tp, pp, dp):
    """This rank's coordinates and, per tp, dp and pp group of the device mesh, its members (an all-gather) and
    the sum of their ranks (an all-reduce): test_zero.py's test_device_mesh_groups_match_rank_math runs it in
    that file's 8-rank spawn, checking it against the rank math here."""
    import torch
    import torch.distributed as dist

    grid = Grid.build(tp, pp, dp, "cpu")
    out = {"coords": grid.coords}
    for dim in ("tp", "dp", "pp"):
        group = getattr(grid, f"{dim}_group")
        members = [None] * dist.get_world_size(group)
        dist.all_gather_object(members, rank, group=group)
        out[dim] = sorted(members)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        out[dim + "_sum"] = t.item()
    # context parallelism: (tp 2, dp 2, cp 2) and (dp 4 with ep 2, cp 2): cp, dp x cp and edp x cp groups
    for name, kwargs in (("cp", dict(tp=2, pp=1, dp=2, cp=2)), ("cp_ep", dict(tp=1, pp=1, dp=4, ep=2, cp=2))):
        g = Grid.build(device_type="cpu", **kwargs)
        out[name] = {"coords": g.coords}
        for comm in ("cp_comm", "dp_comm", "grad_comm", "expert_grad_comm", "pp_comm"):
            members = [None] * g.__dict__[comm].size
            dist.all_gather_object(members, rank, group=g.__dict__[comm].group)
            out[name][comm] = sorted(members)
    return out
