"""Which GPUs each role gets and how GPU memory passes between roles: placement, leases, handoffs, side by side."""
