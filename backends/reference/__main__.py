import sys

from backends.reference.cli import main

sys.exit(main())
