"""`python -m gpt2train.cli`: the same command as `gpt2train`, as it ran when the CLI was one module."""

import sys

from gpt2train.cli import main

sys.exit(main())
