"""The host's utilities, below the Hub, the node arbiter and the kernel alike: cgroups
(:mod:`.cgroups`), the arbiter's socket paths (:mod:`.socket_path`), processes known by
identity rather than by PID (:mod:`.procs`, :mod:`.peers`), the driver's checkpoint and
its helper (:mod:`.checkpoint`), the host's memory (:mod:`.meminfo`) and the arbiter's
control client (:mod:`.arbiter_control`). Nothing here imports the Hub, the arbiter, the
server extension or the kernel side (``tests/unit/test_layout.py``).
"""
