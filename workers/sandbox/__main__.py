from __future__ import annotations

import sys

from workers.sandbox.cli import main

sys.exit(main())
