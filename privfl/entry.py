"""The ``privfl`` console script: :func:`privfl.cli.main` behind a Ctrl-C guard that is in place before it is imported.

Importing the command line takes a while (the accountants, torch: seconds on a loaded machine), and ``cli.main``'s own
guard exists only once that import is done: a Ctrl-C in between would end in a traceback through the import machinery.
This module imports nothing but :mod:`sys`, so the guard below covers the import too: a Ctrl-C at any moment ends
``privfl`` with one line and exit status 130, as ``cli.main`` does once it runs.
"""

import sys


def main() -> int:
    """Import and run the ``privfl`` command; a Ctrl-C while importing it prints ``privfl: interrupted``, gives 130."""
    try:
        from privfl.cli import main as cli_main

        return cli_main()
    except KeyboardInterrupt:
        print("privfl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
