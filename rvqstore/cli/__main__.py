"""``python -m rvqstore.cli`` runs the command line, as the console script does."""

import sys

from . import main

sys.exit(main())
