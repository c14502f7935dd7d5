"""``bench.version_growth`` runs, and what it times side by side computes the same thing."""

from __future__ import annotations

from bench.version_growth import book_with, main, run
from cache_policy.sharing import apply_versions, versions_snapshot
from cache_policy.types import ReplicaId
from cache_policy.versions import NO_SALT
from router.weights.report import span


def test_the_bench_prints_each_row_with_its_baseline(capsys):
    rows = run(300, 2, 3)
    assert [what.split(" ")[0] for what, _, _ in rows] == ["answer's", "apply", "snapshot", "snapshot"]
    assert all(ours > 0 for _, ours, _ in rows) and [b is None for _, _, b in rows] == [False, False, True, True]
    main(["--versions", "300", "--replicas", "2", "--repeat", "2"])
    assert "300 weight versions, 2 replicas" in capsys.readouterr().out


def test_the_fast_paths_give_what_the_baselines_give():
    book = book_with(300, 2)
    kv = book.kv_versions(ReplicaId("replica-0"), NO_SALT)
    assert kv == list(range(300)) and span(299, kv, {}, ordered=True) == span(299, kv, {})
    follower = book_with(300, 2)
    book.finish_update(300, "keep")
    apply_versions(follower, versions_snapshot(book), list(follower.loaded))
    assert follower.history == list(range(301))
