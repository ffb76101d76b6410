"""A kept job: ranks that stay up after %%ddp_train --keep, and the magics that use them (%%ddp, …)."""
