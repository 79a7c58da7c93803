import sys

from cedar.cli import main

sys.exit(main())
