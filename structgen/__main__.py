"""`python -m structgen ...` = `structgen ...` (where the console script is not on PATH)."""

import sys

from structgen.cli import main

if __name__ == "__main__":
    sys.exit(main())
