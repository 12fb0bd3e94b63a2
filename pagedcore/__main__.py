"""``python -m pagedcore`` runs the command line."""

import sys

from pagedcore.cli import entry

sys.exit(entry())
