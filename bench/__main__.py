"""`python -m bench NAME ...`: run one benchmark (what `weir bench NAME ...` executes)."""

import sys

from bench import main

sys.exit(main())
