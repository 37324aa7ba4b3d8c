import sys

from moetrain.prepare.cli import main

sys.exit(main())
