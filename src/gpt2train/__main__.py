import sys

from gpt2train.cli import main

sys.exit(main())
