"""`python -m gpt2train`: the same command as `gpt2train` (what torchrun launches with -m)."""

import sys

from gpt2train.cli import main

sys.exit(main())
