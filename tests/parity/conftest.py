"""Parity tests import the adapters from ``adapters/`` even when the project is not installed."""

import os
import sys

_ADAPTERS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "adapters")
if _ADAPTERS not in sys.path:
    sys.path.insert(0, _ADAPTERS)
