"""``python -m tannery_server serve ...``"""

import sys

from .cli import main

sys.exit(main(prog="python -m tannery_server"))
