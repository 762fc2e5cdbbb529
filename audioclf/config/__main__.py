"""python -m audioclf.config [--update-readme [PATH]]: print the configuration reference, or
regenerate it between the CONFIG-REFERENCE markers of PATH (default docs/configuration.md)."""

import sys
from pathlib import Path

from audioclf.config.reference import readme_with_reference, reference_markdown

DEFAULT_PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

if sys.argv[1:2] == ["--update-readme"]:
    page = Path(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_PAGE
    page.write_text(readme_with_reference(page.read_text()))
else:
    print(reference_markdown())
