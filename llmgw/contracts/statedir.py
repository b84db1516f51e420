"""Where llmgw keeps its state when told nothing else (standard library only: `llmgw ctl`,
`llmgw router` and the configuration all start from it)."""

from __future__ import annotations

import os
from pathlib import Path


def default_state_dir() -> Path:
    """The user's state directory (XDG_STATE_HOME, else ~/.local/state) for llmgw."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "llmgw"
