"""nbddp — train a notebook's fine-tune on every GPU of the machine, from one cell, through torchrun."""

__version__ = "0.1.0"
