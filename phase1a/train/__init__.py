"""Training: packed rows, the optimizer step, checkpoints, ranks and launchers (torchrun, Slurm, Kubernetes),
preemption, progress records, the run history, and checkpoints mirrored to the store."""
