"""bench.instructions: the count read from callgrind's output, its command, and usage errors."""

from __future__ import annotations

import pytest

from bench.instructions import collected, main, valgrind_command


def test_the_count_is_read_from_callgrinds_exit_line():
    err = b"==12== Callgrind, a call-graph generating cache profiler\n==12== Events    : Ir\n==12== Collected : 8925403123\n"
    assert collected(err) == 8_925_403_123
    with pytest.raises(ValueError, match="no instruction count"):
        collected(b"==12== error: something else\n")


def test_the_command_runs_decision_costs_workload_under_callgrind():
    argv = valgrind_command(64, 150, 2000, 3)
    assert argv[:3] == ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    assert "from bench.decision_cost import cost_per_request" in argv[5] and argv[-4:] == ["64", "150", "2000", "3"]


@pytest.mark.parametrize("args, message", [
    (["--short", "50", "--long", "50", "."], "--long must be more than --short"),
    (["/nonexistent-checkout"], "no checkout of this repository"),
])
def test_usage_errors(args, message, capsys, monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)  # judged before valgrind runs
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
