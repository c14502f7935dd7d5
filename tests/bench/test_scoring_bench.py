"""bench.scoring's pure parts: which cores it leaves to the replica's model worker."""

from __future__ import annotations

import os

import pytest

from bench.scoring import isolate_worker_cores
from replicas.config import ReplicaSetConfig


@pytest.fixture
def restore_affinity():
    before = os.sched_getaffinity(0)
    yield before
    os.sched_setaffinity(0, before)


def test_everything_else_leaves_the_worker_core(restore_affinity):
    cores = sorted(restore_affinity)
    if len(cores) < 2:
        assert isolate_worker_cores(ReplicaSetConfig(omp_threads_bind=str(cores[0]))) is None
        assert os.sched_getaffinity(0) == restore_affinity  # nothing pinned
        return
    worker, others = isolate_worker_cores(ReplicaSetConfig(omp_threads_bind=str(cores[-1])))
    assert worker == [cores[-1]]
    assert others == cores[:-1]
    assert os.sched_getaffinity(0) == set(cores[:-1])


def test_a_worker_bound_to_every_core_leaves_nothing_pinned(restore_affinity):
    cores = sorted(restore_affinity)
    spec = ",".join(map(str, cores))
    assert isolate_worker_cores(ReplicaSetConfig(omp_threads_bind=spec)) is None
    assert os.sched_getaffinity(0) == restore_affinity


def test_counts_must_be_positive_integers():
    import argparse

    from bench.scoring import positive_int

    assert positive_int("3") == 3
    for bad in ("0", "-2", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integer"):
            positive_int(bad)
