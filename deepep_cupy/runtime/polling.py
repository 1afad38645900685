"""Bounded host waits for the GPU: one polling loop for every wait on host-mapped memory or an event.

`wait_until(ready, ...)` first spins (a host-mapped word written by a kernel is seen within microseconds, and a
sleep would cost more than the wait), checking the clock and `check` every 64 polls; after 4096 polls it sleeps 50 µs
between polls. With `spin=False` it sleeps from the start, doubling from 10 µs to 1 ms (waits expected to be long,
e.g. a whole stream). Past the deadline it calls `on_timeout`, which raises.
"""

import time
from typing import Callable, NoReturn, Optional

SPIN_CHECK_EVERY = 64
SPIN_POLLS = 4096
SPIN_SLEEP_SECS = 5e-5


def wait_until(ready: Callable[[], bool], timeout_secs: float, on_timeout: Callable[[], NoReturn],
               check: Optional[Callable[[], None]] = None, spin: bool = True) -> None:
    """Return once `ready()` is true.

    Args:
        ready: the condition (cheap: it is polled in a tight loop).
        timeout_secs: bound on the wait.
        on_timeout: called (and must raise) when the bound passes.
        check: called now and then while waiting, e.g. to raise early on a GPU-reported error; may return early
            by raising.
        spin: poll in a tight loop first (True), or sleep with exponential backoff between polls (False).
    """
    if ready():
        return
    deadline = time.monotonic() + timeout_secs
    if spin:
        polls = 0
        while not ready():
            polls += 1
            if polls % SPIN_CHECK_EVERY == 0:
                if check is not None:
                    check()
                if time.monotonic() > deadline:
                    on_timeout()
                if polls > SPIN_POLLS:
                    time.sleep(SPIN_SLEEP_SECS)
        return
    sleep = 1e-5
    while not ready():
        if check is not None:
            check()
        if time.monotonic() > deadline:
            on_timeout()
        time.sleep(sleep)
        sleep = min(sleep * 2, 1e-3)
