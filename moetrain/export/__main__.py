import sys

from moetrain.export.cli import main

sys.exit(main())
