"""``python -m mla_bridge.cli``: the ``mla-bridge`` command."""

import sys

from . import main

sys.exit(main())
