"""``python -m privfl.cli``: the ``privfl`` command."""

import sys

from privfl.cli import main

sys.exit(main())
