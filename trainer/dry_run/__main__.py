import sys

from trainer.dry_run.cli import main

sys.exit(main())
