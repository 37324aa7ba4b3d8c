import sys

from trainer.evaluate.cli import main

sys.exit(main())
