"""``python -m tannery.cli``: the ``tannery`` command."""

import sys

from . import main

sys.exit(main())
