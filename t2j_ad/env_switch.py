"""On/off switches read from the environment (``T2J_AD_TUNE_MALLOC``, ``T2J_AD_FUNCTORCH_FAST``)."""

from __future__ import annotations

import os

_ON = ("", "1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def env_switch(name: str, *, on: str, off: str) -> bool:
    """Whether the switch ``name`` is on; unset or empty means on.

    ``on`` and ``off`` say what each setting does, for the error a value
    outside 1/0 (true/false, yes/no, on/off) raises.
    """
    value = os.environ.get(name, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{name} must be 1 ({on}, the default) or 0 ({off}), got {value!r}.")
