"""The distributed layer. Here, the group: the world a worker runs in (its place, and the data-parallel group it
reads data for), the process group and its collectives, the store barrier, heartbeats, the world's layout;
``launch/``: starting the workers and the checks and failure reports around them; ``parallel/``: how a model is
made data-parallel over the ranks (DDP, FSDP, hybrid sharding). Engine code reaches ``torch.distributed`` only
through here."""
