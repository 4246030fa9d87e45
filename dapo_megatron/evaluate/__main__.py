"""`python -m dapo_megatron.evaluate`: the command line of dapo_megatron/evaluate/__init__.py."""
import sys

from dapo_megatron.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
