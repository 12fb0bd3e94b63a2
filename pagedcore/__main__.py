"""``python -m pagedcore`` runs the command line."""

import sys

from pagedcore.cli import main

sys.exit(main())
