"""``python -m privfl``: the ``privfl`` command (:func:`privfl.entry.main`, with its Ctrl-C guard), for an
environment whose PATH lacks the console script."""

import sys

from privfl.entry import main

sys.exit(main())
