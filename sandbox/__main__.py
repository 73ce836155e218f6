from __future__ import annotations

import sys

from sandbox.cli import main

sys.exit(main())
