"""`python -m sdvg ...`: the `sdvg` command."""
import sys

from sdvg.cli.main import main

sys.exit(main())
