"""`python -m sdvg.cli ...` (e.g. under torchrun): the `sdvg` command."""
import sys

from sdvg.cli.main import main

sys.exit(main())
