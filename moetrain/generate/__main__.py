import sys

from moetrain.generate.cli import main

sys.exit(main())
