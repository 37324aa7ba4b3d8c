import sys

from trainer.dry_run.cli import main

# NOTE: guarded, since the search's worker processes (trainer.dry_run.workers) are spawned
# and import the parent's main module again
if __name__ == "__main__":
    sys.exit(main())
