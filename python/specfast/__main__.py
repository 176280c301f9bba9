"""`python -m specfast`: the same as the `specfast` command."""

import sys

from specfast.cli import main

sys.exit(main())
