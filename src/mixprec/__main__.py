"""``python -m mixprec`` runs the same command line as the ``mixprec`` console script."""

import sys

from mixprec.programs.cli import main

if __name__ == "__main__":
    sys.exit(main())
