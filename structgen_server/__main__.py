"""`python -m structgen_server --model ... --host ... --port ...` = `structgen serve ...`."""

import sys

from structgen.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
