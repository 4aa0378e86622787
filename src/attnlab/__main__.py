"""``python -m attnlab`` is the ``attnlab`` command (also what ``torchrun -m attnlab`` runs)."""
import sys

from attnlab.cli import main

sys.exit(main())
