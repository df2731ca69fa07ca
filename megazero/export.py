"""``python -m megazero.export``: a checkpoint as a Hugging Face model folder (megazero.interop.export)."""
import sys

from megazero.interop.export import main

if __name__ == "__main__":
    sys.exit(main())
