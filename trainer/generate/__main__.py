import sys

from trainer.generate.cli import main

sys.exit(main())
