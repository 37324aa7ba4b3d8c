import sys

from moetrain.planner.cli import main

# NOTE: guarded, since the search's worker processes (moetrain.planner.workers) are spawned
# and import the parent's main module again
if __name__ == "__main__":
    sys.exit(main())
