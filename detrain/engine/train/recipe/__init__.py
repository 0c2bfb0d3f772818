"""The recipe's optimizer: its choice, parameter groups, learning-rate schedule and warmup (``optim``), and MuSGD,
the optimizer ``optimizer=auto`` picks for long runs (``musgd``)."""
