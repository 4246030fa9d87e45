"""`python -m dapo_megatron.tools.check_sync`: the command line of tools/check_sync/__init__.py."""
import sys

from dapo_megatron.tools.check_sync import main

if __name__ == "__main__":
    sys.exit(main())
