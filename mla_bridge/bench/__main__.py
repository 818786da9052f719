"""``python -m mla_bridge.bench``: the same as ``mla-bridge bench``."""

import sys

from . import main

sys.exit(main())
