"""`python -m sdvg.cli ...`: the `sdvg` command (the form torchrun runs)."""
import sys

from sdvg.cli.main import main

sys.exit(main())
