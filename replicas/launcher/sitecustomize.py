"""Run first by every Python process of a replica (``replicas/launcher`` is on its ``PYTHONPATH``).

With ``ROLLOUT_ROUTER_DIE_WITH_PARENT=1`` a process that has no parent-death signal yet asks
Linux for ``SIGKILL`` when its parent dies (``prctl(PR_SET_PDEATHSIG)``). The API server keeps
the ``SIGTERM`` the launcher shim gave it (``exec`` preserves it); its engine core and the
engine core's workers (fresh interpreters started by multiprocessing ``spawn``) get ``SIGKILL``,
so a SIGKILLed API server takes its engine core, and that one its workers, down with it.
A process whose parent is already gone when it starts exits at once. Never raises: a failure
here must not stop vLLM (the replica's process-group kill still reaps it).
"""

import os

if os.environ.get("ROLLOUT_ROUTER_DIE_WITH_PARENT") == "1":
    try:
        import ctypes
        import signal

        _libc = ctypes.CDLL(None, use_errno=True)
        _current = ctypes.c_int(0)
        _libc.prctl(2, ctypes.byref(_current), 0, 0, 0)  # PR_GET_PDEATHSIG
        if _current.value == 0:
            _libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
            if os.getppid() == 1:
                os._exit(1)
    except Exception:
        pass
