"""Every rank's checksums of what it wrote, gathered by rank 0 before it commits a save
(the COMPLETE marker lists them; moetrain.checkpoint.checkpointer). The wait is bounded, says
whom it waits for, and gives up within torchrun's grace period after SIGTERM, so a save
whose peer died is not committed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

from moetrain.errors import CheckpointError

# How long rank 0 waits for a peer's checksums before giving up on the commit, how long
# before it says whom it is waiting for, and how long once SIGTERM came.
SUMS_TIMEOUT_S = 600.0
SUMS_SAY_AFTER_S = 30.0
# NOTE: not zero: SIGTERM also starts the preemption save, whose healthy peers are still
# hashing; below torchrun's 30 s grace, after which its SIGKILL ends every wait anyway.
SUMS_SIGTERM_GRACE_S = 20.0


def gather_sums(
    tmp: str,
    world: int,
    stop_requested: Callable[[], bool],
    timeout: float = SUMS_TIMEOUT_S,
    say_after: float = SUMS_SAY_AFTER_S,
    grace: float = SUMS_SIGTERM_GRACE_S,
) -> dict[str, str]:
    """Every rank's `.sums-<rank>.json` in `tmp`, merged, once all are there.

    The wait is bounded (`timeout`), says after `say_after` seconds which ranks it waits for,
    and after SIGTERM (`stop_requested`) lasts at most `grace` more seconds: a peer that died
    before writing its checksums makes torchrun stop the job, and the commit must give up
    within torchrun's grace period.
    """
    paths = [os.path.join(tmp, f".sums-{r}.json") for r in range(world)]
    start, said, signalled = time.monotonic(), False, None
    while missing := [r for r, p in enumerate(paths) if not os.path.isfile(p)]:
        now = time.monotonic()
        if signalled is None and stop_requested():
            signalled = now
        who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing[:8]))}"
        if now - start > timeout or (signalled is not None and now - signalled > grace):
            why = "SIGTERM came" if signalled is not None else f"{timeout:.0f} s passed"
            raise CheckpointError(
                f"{tmp}: {why} while waiting for {who} to write its checksums (the rank died "
                "or hangs); this save was not committed"
            )
        if now - start > say_after and not said:
            print(f"checkpoint commit: waiting for {who} to write its checksums", file=sys.stderr)
            said = True
        time.sleep(0.05)
    files: dict[str, str] = {}
    for p in paths:
        with open(p) as f:
            files.update(json.load(f))
        os.remove(p)
    return files
