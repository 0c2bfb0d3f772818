"""The distributed layer: the world a worker runs in, the process group and its collectives, the launcher, and
the checks and failure reports around them; how a model is made data-parallel over the ranks (``parallel``).
Engine code reaches ``torch.distributed`` only through here."""
