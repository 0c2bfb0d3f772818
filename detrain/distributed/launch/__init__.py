"""Launching the workers of a run: torch's elastic launcher (or a plain call) and what surrounds it - the device
plan, the checks before any worker starts, the rendezvous store's server, run identities, SLURM's variables,
restarts and preemption marks, NCCL's words, every node ending together and a failed worker named in one line."""
