import sys

from tplab.cli import main

sys.exit(main())
