import sys

from trainer.prepare.cli import main

sys.exit(main())
