"""`python -m tierkv ...`: the `tierkv` command (`tierkv --help`); the main job is `python -m tierkv.demo`."""
import sys

from tierkv.cli import main

sys.exit(main())
