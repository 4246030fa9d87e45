"""`python -m dapo_megatron.convert`: the command line of dapo_megatron/convert/__init__.py."""
from dapo_megatron.convert import _exit_now, main

if __name__ == "__main__":
    _exit_now(main())
