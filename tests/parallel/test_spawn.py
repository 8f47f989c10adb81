"""The gloo worlds of tests/harness.py: a rank that hangs fails its test within the deadline,
showing where it waits, and a process that builds layout after layout keeps one set of groups."""

import time

import pytest
import torch.distributed as dist

import harness

pytestmark = pytest.mark.dist


def wait_on_a_missing_rank(rank, world_size):
    if rank == 0:
        dist.barrier()  # rank 1 never comes
    else:
        time.sleep(600)


def test_a_hung_world_fails_by_its_deadline_with_each_ranks_stack(monkeypatch, capfd):
    monkeypatch.setenv("MEGATRON_EXT_TEST_SPAWN_TIMEOUT", "30")  # ranks reach fn in about 5 s
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="its 2 ranks did not finish in 30 s"):
        harness.spawn(wait_on_a_missing_rank, 2)
    assert time.monotonic() - began < 90
    stacks = capfd.readouterr().err
    assert stacks.count("in wait_on_a_missing_rank") == 2, stacks


def groups_after_each_layout(rank, world_size):
    counts = []
    for tp in (2, 1, 2):
        harness.init_parallel(tp=tp)
        counts.append(len(dist.distributed_c10d._world.pg_map))
    return counts


def test_a_new_layout_replaces_the_groups_of_the_last():
    for counts in harness.spawn(groups_after_each_layout, 2):
        assert counts[0] == counts[2], counts
