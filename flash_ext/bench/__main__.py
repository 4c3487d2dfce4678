"""``python -m flash_ext.bench``: see flash_ext/bench/__init__.py."""
import sys

from .cli import main

sys.exit(main())
