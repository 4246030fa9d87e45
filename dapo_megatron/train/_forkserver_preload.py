"""Imported once by the forkserver of `train.forkserver`, so that every rank forked from it
starts with these imports done. Nothing here may start a thread or touch a device: the server
must stay single-threaded for its forks to be safe."""
from dapo_megatron import heap
from dapo_megatron.device.megatron_cpu import import_without_compile

# The forks inherit the server's heap frozen: their collections skip these imports' objects.
with heap.start_up():
    # Its forks convert checkpoints (and, in tests, run CPU ranks): no compiled function of megatron
    # does work in them on any device, so its torch.compile decorations (inductor's imports) go.
    import_without_compile()

    import megatron.core.dist_checkpointing  # noqa: F401,E402
    import megatron.core.models.gpt  # noqa: F401,E402
    import megatron.core.parallel_state  # noqa: F401,E402
    from transformers import AutoConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig  # noqa: F401,E402

    import dapo_megatron.models.gpt  # noqa: F401,E402
    import dapo_megatron.weights.export  # noqa: F401,E402
    import dapo_megatron.weights.load  # noqa: F401,E402

# The server exits (SystemExit) when its last client closes; tearing down the modules above
# then takes ~1.5 s, which every command that waits for its output pipes would pay. The
# server owns no files or buffers, and its children leave through os._exit already.
import atexit  # noqa: E402
import os  # noqa: E402

atexit.register(os._exit, 0)
