"""`python -m audioclf.serve`: the CLI of audioclf/serve/cli.py (the package is the library)."""

import sys

from audioclf.serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
