"""VersionBook: salts by policy, step tags without churn, session starts, routing exclusions."""

from __future__ import annotations

import pytest

from cache_policy.registry import KeyRegistry
from cache_policy.types import ReplicaId
from cache_policy.versions import VersionBook

A, B = ReplicaId("replica-0"), ReplicaId("replica-1")


class Book:
    """A VersionBook over two replicas, with its key registry (ttl 100 s)."""

    def __init__(self, policy: str = "keep+salt", initial: int | None = 0) -> None:
        self.v = VersionBook(policy, initial)  # type: ignore[arg-type]
        self.reg = KeyRegistry(1000, ttl_s=100.0)
        for rid in (A, B):
            self.v.set_loaded(rid, initial)

    def assign(self, now: float, session_id=None, group_id=None, weight_version=None, tenant=None):
        self.reg.advance(now)
        self.reg.expire(now)
        return self.v.assign(self.reg, session_id, group_id, weight_version, tenant)

    def update(self, version: int, policy: str | None = None) -> None:
        for rid in (A, B):
            self.v.set_loaded(rid, version)
        self.v.finish_update(version, policy or self.v.policy)


def test_step_tags_without_a_weight_change_keep_one_salt():
    b = Book("salt")
    salts = {b.assign(0.0, weight_version=step).salt for step in (None, 0, 3, 9)}
    assert salts == {"rr:v0"}
    b.update(10)
    assert b.assign(1.0, weight_version=12).salt == "rr:v10"
    assert b.assign(1.0).salt == "rr:v10"
    assert b.assign(1.0, weight_version=7).salt == "rr:v0"  # tagged with the old version


@pytest.mark.parametrize("policy", ["flush", "keep"])
def test_flush_and_keep_send_no_salt(policy):
    b = Book(policy)
    choice = b.assign(0.0, session_id="s")
    assert choice.salt is None and choice.version == 0 and b.v.excluded(choice) == set()


def test_keep_plus_salt_sessions_keep_their_start_salt_new_ones_get_the_new():
    b = Book("keep+salt")
    assert b.assign(0.0, session_id="old", group_id="g").salt == "rr:v0"
    b.update(1)
    kept = b.assign(1.0, session_id="old", weight_version=1)
    assert (kept.salt, kept.salt_version, kept.version) == ("rr:v0", 0, 1)
    assert b.assign(1.0, group_id="g").salt == "rr:v0"  # the group started before too
    assert b.assign(1.0, session_id="new").salt == "rr:v1"
    assert b.assign(1.0, group_id="g2").salt == "rr:v1"
    # a tool call longer than session_idle_s keeps the start version (issue 9: the horizon is key_ttl_s)
    assert b.assign(50.0, session_id="old").salt == "rr:v0"
    assert b.assign(151.0, session_id="old").salt == "rr:v1"  # forgotten after 100 s unseen: afresh


def test_salt_policy_resalts_continuing_sessions():
    b = Book("salt")
    b.assign(0.0, session_id="s")
    b.update(1)
    assert b.assign(1.0, session_id="s").salt == "rr:v1"


def test_salted_requests_go_to_replicas_serving_their_version():
    b = Book("salt")
    b.v.set_loaded(A, 1)  # rolling update: A done, B still on 0
    b.v.finish_update(1, "salt")
    new = b.assign(0.0)
    assert new.salt == "rr:v1" and b.v.excluded(new) == {B}
    old = b.assign(0.0, weight_version=0)
    assert old.salt == "rr:v0" and b.v.excluded(old) == {A}
    b.v.rotation[A] = "updating"
    assert b.v.excluded(new) == {A, B}  # nobody in rotation serves v1: the core re-salts it
    assert b.v.updating()
    del b.v.rotation[A]
    assert not b.v.updating()


def test_version_log_reports_mixed_versions():
    b = Book()
    mark = b.v.mark(A)
    assert b.v.versions_since(A, mark) == [0]
    b.v.set_loaded(A, 1)
    assert b.v.versions_since(A, mark) == [0, 1]
    assert b.v.versions_since(A, b.v.mark(A)) == [1]
    assert b.v.loaded[A] == 1


def test_unknown_initial_version_means_no_salt_until_an_update():
    b = Book("salt", initial=None)
    assert b.assign(0.0).salt is None
    b.update(3)
    assert b.assign(0.0).salt == "rr:v3"
    with pytest.raises(ValueError, match="weight_update_policy"):
        Book("salted")


@pytest.mark.parametrize("policy", ["flush", "keep", "salt", "keep+salt"])
def test_a_tenant_is_folded_into_every_salt(policy):
    b = Book(policy)
    mine, theirs, none = (b.assign(0.0, tenant=t).salt for t in ("a", "b", None))
    assert mine != theirs and None not in (mine, theirs) and none not in (mine, theirs)


def test_scoring_is_salted_by_its_own_version_under_every_policy_but_flush():
    for policy in ("keep", "salt", "keep+salt"):
        b = Book(policy)
        b.assign(0.0, session_id="s")  # the session starts under v0
        b.update(1)
        score = b.v.assign(b.reg, "s", None, None, scoring=True)
        assert (score.salt, score.version, score.salt_version, score.pins_version) == ("rr:v1", 1, 1, True)
    flush = Book("flush")
    assert flush.v.assign(flush.reg, None, None, None, scoring=True).salt is None


def test_kv_versions_strict_continuing_and_unsalted():
    b = Book("keep+salt")
    old = b.assign(0.0, session_id="old")
    b.update(1)
    kept = b.assign(1.0, session_id="old")
    assert (kept.salt_version, kept.pins_version) == (0, False)
    assert b.v.kv_versions(A, kept) == [0, 1]  # v0 blocks and the hybrid blocks v1 wrote since
    new = b.assign(1.0, session_id="new")
    assert b.v.kv_versions(A, new) == [1]
    assert b.v.kv_versions(A, old) == [0]  # strict on a v0 replica: v0's namespace only
    unsalted = Book("keep")
    unsalted.update(1)
    plain = unsalted.assign(0.0)
    assert unsalted.v.kv_versions(A, plain) == [0, 1]  # keep: the cache holds both versions
    unsalted.v.cache_reset(A)
    assert unsalted.v.kv_versions(A, plain) == [1]  # a confirmed reset: only what is loaded


def test_choice_for_and_staleness():
    b = Book("salt")
    b.update(5)
    again = b.v.choice_for(5, "t")
    assert (again.salt, again.version, again.salt_version) == ("rr:v5|t=t", 5, 5) and again.pins_version
    assert not b.v.too_stale(2, None)  # off by default
    assert not b.v.too_stale(3, 2) and b.v.too_stale(2, 2) and not b.v.too_stale(None, 0)


def test_excluded_equals_the_scan_under_any_loaded_history():
    """``excluded`` skips its scan of ``loaded`` when every replica serves the request's version
    (the per-version counts): under generated histories of loads, departures and forgotten
    versions its answer equals the plain scan, and the counts equal a recount (``check_integrity``)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from cache_policy.sharing import unconfirmed
    from cache_policy.versions import SaltChoice

    rids = [ReplicaId(f"replica-{i}") for i in range(4)]
    op = st.one_of(st.tuples(st.just("load"), st.sampled_from(rids), st.sampled_from([None, 0, 1, 2])),
                   st.tuples(st.just("leave"), st.sampled_from(rids), st.none()),
                   st.tuples(st.just("forget"), st.none(), st.none()),
                   st.tuples(st.just("rotate"), st.sampled_from(rids), st.none()))

    @settings(max_examples=300, deadline=None)
    @given(st.lists(op, max_size=30), st.sampled_from([None, 0, 1, 2]))
    def run(ops, version):
        book = VersionBook("salt", 0)
        for kind, rid, v in ops:
            if kind == "load":
                book.set_loaded(rid, v)
            elif kind == "leave":
                book.forget_replica(rid)
            elif kind == "forget":
                unconfirmed(book)
            else:
                book.rotation[rid] = "updating"
            book.check_integrity()
            for choice in (SaltChoice("x", version, version, True), SaltChoice("x", version, None)):
                want = set(book.rotation)
                if choice.pins_version:
                    want |= {r for r, lv in book.loaded.items() if lv != version}
                assert book.excluded(choice) == want
                for rid in rids:  # allows() is the same question for one replica, without the set
                    assert book.allows(rid, choice) == (rid not in want)

    run()


def test_versions_since_and_kv_versions_agree_with_the_whole_log_under_any_history():
    """The book keeps a replica's version log cut to its newest entries (``LOG_KEPT``) and its
    cached versions ascending, read by bisection: under generated histories (versions up and down,
    repeats, resets, departures) and marks taken at any time, ``kv_versions`` equals the plain
    scan of every version loaded since the last reset, and ``versions_since`` equals the slice of
    the whole log while the mark is kept, and says "moved" (more than one) exactly when the whole
    log does once it is not."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from cache_policy import versions as V
    from cache_policy.versions import SaltChoice

    rids = [ReplicaId("replica-0"), ReplicaId("replica-1")]
    op = st.one_of(st.tuples(st.just("load"), st.sampled_from(rids), st.integers(0, 40)),
                   st.tuples(st.just("climb"), st.sampled_from(rids), st.integers(1, 30)),
                   st.tuples(st.just("reset"), st.sampled_from(rids), st.none()),
                   st.tuples(st.just("leave"), st.sampled_from(rids), st.none()),
                   st.tuples(st.just("mark"), st.sampled_from(rids), st.none()))

    @settings(max_examples=300, deadline=None)
    @given(st.lists(op, max_size=40), st.integers(0, 45))
    def run(ops, salt_version):
        book = VersionBook("keep+salt", 0)
        log: dict = {}  # the whole log per replica, and the versions cached since the last reset
        cached: dict = {}
        marks = []  # (replica, the book's mark, the position in the whole log)
        for kind, rid, arg in ops:
            steps = [arg] if kind == "load" else [book.loaded.get(rid, 0) or 0] if kind == "climb" else []
            if kind == "climb":  # many updates in a row: the log is cut
                steps = list(range(steps[0] + 1, steps[0] + 1 + arg * 5))
            for version in steps:
                whole = log.setdefault(rid, [])
                if not whole or whole[-1] != version:
                    whole.append(version)
                    cached.setdefault(rid, set()).add(version)
                book.set_loaded(rid, version)
            if kind == "reset":
                book.cache_reset(rid)
                cached[rid] = {book.loaded[rid]} if book.loaded.get(rid) is not None else set()
            elif kind == "leave":
                book.forget_replica(rid)
                log.pop(rid, None), cached.pop(rid, None)
                marks = [m for m in marks if m[0] != rid]
            elif kind == "mark":
                marks.append((rid, book.mark(rid), max(0, len(log.get(rid, [])) - 1)))
            book.check_integrity()
            for r in rids:
                assert len(book._log.get(r, [])) <= 2 * V.LOG_KEPT
                held = cached.get(r) or ({book.loaded[r]} if book.loaded.get(r) is not None else set())
                assert book.kv_versions(r, SaltChoice(None, None, None)) == sorted(held)
                continuing = SaltChoice("x", salt_version + 1, salt_version)  # keep+salt, started before
                assert book.kv_versions(r, continuing) == sorted({salt_version} | {v for v in held if v >= salt_version})
            for r, mark, position in marks:
                got, want = book.versions_since(r, mark), log.get(r, [])[position:]
                if mark >= book._log_base.get(r, 0):
                    assert got == want
                else:
                    assert len(want) > 1 and len(got) > 1

    run()


def test_a_week_of_updates_every_step_keeps_the_version_log_bounded():
    """A trainer updating weights every step for a week (20,000 updates, one every 30 s) on 8
    replicas: each replica's log stays within ``2 * LOG_KEPT`` entries, a request marked before
    the first update reads as moved, one marked at the last reads one version, and a continuing
    keep+salt key started 10 updates ago reads those 11 versions."""
    from cache_policy.versions import LOG_KEPT, SaltChoice

    rids = [ReplicaId(f"replica-{i}") for i in range(8)]
    book = VersionBook("keep+salt", 0)
    for rid in rids:
        book.set_loaded(rid, 0)
    first = book.mark(rids[0])
    for version in range(1, 20_001):
        for rid in rids:
            book.set_loaded(rid, version)
        book.finish_update(version, "keep+salt")
    book.check_integrity()
    assert all(len(book._log[rid]) <= 2 * LOG_KEPT for rid in rids)
    assert len(book.versions_since(rids[0], first)) > 1
    assert book.versions_since(rids[0], book.mark(rids[0])) == [20_000]
    assert book.kv_versions(rids[3], SaltChoice("rr:v19990", 20_000, 19_990)) == list(range(19_990, 20_001))
    assert book.resolve(12_345) == 12_345 and book.history[-1] == 20_000
