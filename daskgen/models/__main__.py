"""``python -m daskgen.models``."""

import sys

from daskgen.models.cli import main

sys.exit(main())
