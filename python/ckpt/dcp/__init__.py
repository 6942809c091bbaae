"""ckpt.dcp: ckptd as the storage of torch.distributed.checkpoint (DCP).

    import torch.distributed.checkpoint as dcp
    from ckpt.dcp import CkptReader, CkptWriter

    writer = CkptWriter("llama-7b")            # one per training process
    dcp.save(state_dict, checkpoint_id="step-100", storage_writer=writer)
    saving = dcp.async_save(state_dict, checkpoint_id="step-200", storage_writer=writer)
    ...
    dcp.load(state_dict, checkpoint_id="step-200", storage_reader=CkptReader("llama-7b"))

The writer is also DCP's AsyncStager, so async_save stages into ckptd: CPU
tensors are copied once into memory ckptd maps, CUDA tensors are taken by
ckptd where they are (through CUDA IPC), and the trainer goes on;
ckptd writes them with io_uring, checksums and fsync, in its own process.
A tensor whose bytes are what ckptd already holds is not written again (the
frozen base of a LoRA fine-tune is written once). A checkpoint exists once
the coordinator's finish() has stored its metadata in ckptd, after every
rank's bytes were durable; a load finds it by checkpoint id (or the newest
without one), verifies every version's checksum, and may run on another
world size or parallelism: DCP's planner reshards.

The package: ``store`` (one rank's tensors in ckptd), ``gpu_store`` (its
CUDA tensors, in place), ``catalog`` (the
checkpoints of a job and their metadata), ``writer`` and ``reader`` (DCP's
interfaces). See docs/dcp.md.
"""

from .reader import CkptReader
from .writer import CkptWriter

__all__ = ["CkptReader", "CkptWriter"]
