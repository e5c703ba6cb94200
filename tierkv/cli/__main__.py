import sys

from tierkv.cli import main

sys.exit(main())
