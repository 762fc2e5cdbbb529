"""`python -m audioclf.search`: the CLI of audioclf/search/cli.py (the package is the library)."""

import sys

from audioclf.search.cli import main

if __name__ == "__main__":
    sys.exit(main())
