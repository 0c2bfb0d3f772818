"""The integration tests share the helper modules in tests/ (``_processes``, ``_agree_node``, ...): that folder goes
on the import path, as it is for the tests in it."""

from __future__ import annotations

import sys
from pathlib import Path

HELPERS = str(Path(__file__).resolve().parents[1])
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)
