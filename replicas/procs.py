"""Which processes make up a replica, read from ``/proc`` (Linux).

A replica's server is started in a new session, so its process group id is the server's pid and
every engine process it starts (engine core, workers, multiprocessing's resource tracker)
shares it. A zombie (state ``Z``) holds no memory and counts as gone.
"""

from __future__ import annotations

import os


def group_members(pgid: int) -> list[int]:
    """Pids of live (non-zombie) processes whose process group is ``pgid``, ascending."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _stat(int(name))
        if stat is not None and stat[2] == pgid and stat[0] != "Z":
            members.append(int(name))
    return sorted(members)


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid``; None if it is gone or unreadable."""
    stat = _stat(pid)
    return stat[1] if stat is not None else None


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of ``pid`` from ``/proc/<pid>/stat``; None if it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after the last ")"
    fields = text[text.rfind(")") + 2:].split()
    if len(fields) < 3 or not fields[1].lstrip("-").isdigit() or not fields[2].lstrip("-").isdigit():
        return None
    return fields[0], int(fields[1]), int(fields[2])
