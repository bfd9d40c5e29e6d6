"""`python -m hf_paged serve MODEL_PATH ...`: the `hf-paged` command."""

import sys

from .serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
