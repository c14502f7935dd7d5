"""The router's lock-free metric classes (``router.metrics``) expose exactly what
prometheus_client's own would after the same updates, errors included."""

from __future__ import annotations

import prometheus_client
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from router.metrics import Counter, Gauge, Histogram

_amounts = st.floats(allow_nan=True, allow_infinity=True, width=32) | st.integers(-5, 5)
_ops = st.lists(st.tuples(st.sampled_from(["inc", "set", "dec", "observe", "parent"]),
                          st.sampled_from(["a", "b"]), _amounts), max_size=30)


def _exposition(counter, gauge, histogram, ops) -> tuple[str, list[str]]:
    r = CollectorRegistry()
    c, g = counter("c", "c", ["k"], registry=r), gauge("g", "g", ["k"], registry=r)
    h = histogram("h", "h", ["k"], registry=r, buckets=(0.1, 1, 5))
    errors = []
    for op, label, amount in ops:
        try:
            if op == "inc":
                c.labels(label).inc(amount)
            elif op == "set":
                g.labels(label).set(amount)
            elif op == "dec":
                g.labels(label).dec(amount)
            elif op == "observe":
                h.labels(label).observe(amount)
            else:
                (c.inc, g.set, h.observe)[hash(label) % 3](amount)
        except ValueError as exc:
            errors.append(str(exc))
    text = generate_latest(r).decode()
    return "\n".join(line for line in text.splitlines() if "_created" not in line), errors


@settings(max_examples=200, deadline=None)
@given(_ops)
def test_the_lock_free_metrics_expose_what_prometheus_clients_do(ops):
    ours = _exposition(Counter, Gauge, Histogram, ops)
    theirs = _exposition(prometheus_client.Counter, prometheus_client.Gauge, prometheus_client.Histogram, ops)
    assert ours == theirs
