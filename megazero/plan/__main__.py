"""``python -m megazero.plan``: the layout search (megazero.plan.cli)."""
import sys

from megazero.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
