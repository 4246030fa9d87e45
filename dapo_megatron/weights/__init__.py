"""HF <-> Megatron weights: name tables, reshapes, streaming load, bucketed export.

    load_hf_checkpoint(chunks, hf_dir)                    # each rank reads only its slices
    for bucket in export_hf(chunks, bucket_bytes=1 << 30):  # collective; [(hf_name, tensor)]
        ...
"""
from dapo_megatron.weights.export import export_hf, iter_hf_tensors  # noqa: F401
from dapo_megatron.weights.hf_io import CheckpointError, HFCheckpoint  # noqa: F401
from dapo_megatron.weights.load import load_hf_checkpoint  # noqa: F401
