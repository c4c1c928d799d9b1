"""``python -m loadtest ...`` is ``tokengate loadtest ...``."""

import sys

from loadtest.cli import main

sys.exit(main())
