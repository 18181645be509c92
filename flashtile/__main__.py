import sys

from flashtile.cli import main

sys.exit(main())
