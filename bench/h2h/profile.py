"""py-spy on our router's process during the latency run: where its time goes.

``start`` launches ``py-spy record --format raw`` (collapsed stacks) on a pid; ``stop`` ends it
(SIGINT, py-spy then writes its file) and ``top_frames`` sums samples per frame: ``self`` (the
frame on top of the stack) and ``total`` (anywhere on it), as shares of all samples.
"""

from __future__ import annotations

import signal
import subprocess
from collections import Counter
from pathlib import Path


def start(pid: int, out: Path, venv: Path, rate: int = 250) -> tuple[subprocess.Popen, Path]:
    """Start sampling ``pid``; returns the py-spy process and its output path."""
    path = out / "ours-latency.pyspy.txt"
    proc = subprocess.Popen([str(venv / "bin" / "py-spy"), "record", "--pid", str(pid), "--format", "raw",
                             "--rate", str(rate), "--output", str(path), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, path


def stop(spy: tuple[subprocess.Popen, Path], top: int = 15) -> dict:
    """Stop sampling; the top frames (or py-spy's error when it could not sample)."""
    proc, path = spy
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    if not path.exists():
        return {"error": err.decode(errors="replace")[-500:]}
    return {"file": str(path), **top_frames(path.read_text(), top)}


def top_frames(collapsed: str, top: int = 15) -> dict:
    """Per-frame sample shares from py-spy's raw format (``f1;f2;...;fn count`` per line)."""
    own, anywhere, total = Counter(), Counter(), 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            anywhere[f] += n
    share = lambda c: [(f, round(k / total, 4)) for f, k in c.most_common(top)] if total else []  # noqa: E731
    return {"samples": total, "self": share(own), "total": share(anywhere)}
