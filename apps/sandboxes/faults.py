"""Named fault points for fault-injection tests of the real stack.

``HEDGEROW_FAULTS="provision.after_backend=sleep:30,exec.before_agent=exit"`` makes the
process that reads it pause or die at those points. Unset (always, in production) it
costs one dict lookup.
"""

from __future__ import annotations

import functools
import os
import time


@functools.cache
def _faults() -> dict[str, str]:
    raw = os.environ.get("HEDGEROW_FAULTS", "")
    pairs = (item.split("=", 1) for item in raw.split(",") if "=" in item)
    return {name.strip(): action.strip() for name, action in pairs}


def fault_point(name: str) -> None:
    action = _faults().get(name)
    if action is None:
        return
    if action.startswith("sleep:"):
        time.sleep(float(action.split(":", 1)[1]))
    elif action == "exit":
        os._exit(97)
