"""Where ranks come from: torchrun's and Slurm's environments, and device choice."""
import pytest
import torch

from megazero.errors import UserError
from megazero.launch import expand_nodelist, pick_device, process_info


def test_plain_python_is_world_size_one():
    info = process_info({})
    assert (info.rank, info.world_size, info.local_rank, info.launcher) == (0, 1, 0, "single")


def test_torchrun_environment():
    env = {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "MASTER_ADDR": "node3", "MASTER_PORT": "29400",
           "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}  # torchrun inside a Slurm allocation: torchrun wins
    info = process_info(env)
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.master_port, info.launcher) == \
        (5, 16, 1, "node3", 29400, "torchrun")


def test_slurm_environment_takes_the_first_host_as_rendezvous():
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[07-08,11],login", "SLURM_JOB_ID": "123456"}
    info = process_info(env)
    assert (info.rank, info.world_size, info.local_rank, info.launcher) == (9, 16, 1, "slurm")
    assert info.master_addr == "gpu07"
    assert 20000 <= info.master_port < 30000
    assert process_info({**env, "MASTER_ADDR": "head", "MASTER_PORT": "1234"}).master_addr == "head"


@pytest.mark.parametrize("nodelist,hosts", [
    ("node1", ["node1"]),
    ("a[1-3]", ["a1", "a2", "a3"]),
    ("gpu[007-009,012],cpu5", ["gpu007", "gpu008", "gpu009", "gpu012", "cpu5"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_device_choice():
    assert pick_device("cpu", 0).type == "cpu"
    if torch.cuda.is_available():
        assert pick_device("auto", 0).type == "cuda"
    else:
        assert pick_device("auto", 0).type == "cpu"
        with pytest.raises(UserError, match="launch.device='cuda'"):
            pick_device("cuda", 0)


def test_gpus_per_node(monkeypatch):
    """One process per GPU: auto falls back to the CPU with too few GPUs; launch.device=cuda refuses (NCCL would
    fail later with two ranks on one GPU), with the torchrun flag that fits."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert pick_device("auto", 3, local_world=8).type == "cpu"
    with pytest.raises(UserError, match=r"8 processes on this node but 2 GPUs visible.*--nproc-per-node 2"):
        pick_device("cuda", 3, local_world=8)
    assert chosen == []
    assert pick_device("cuda", 1, local_world=2) == torch.device("cuda", 1)
    assert pick_device("auto", 0, local_world=2) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # one GPU in the node, eight processes: refuse
    with pytest.raises(UserError, match=r"8 processes on this node but 1 GPUs visible"):
        pick_device("cuda", 5, local_world=8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # a GPU bound to each task: its own is cuda:0
    assert pick_device("cuda", 5, local_world=8) == torch.device("cuda", 0)
    assert chosen == [torch.device("cuda", 1), torch.device("cuda", 0), torch.device("cuda", 0)]
