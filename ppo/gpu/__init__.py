"""Which GPUs each role gets and how GPU memory passes between roles: placement, the phase plan
and its memory plan, leases, handoffs, side by side, the weight-broadcast group across nodes."""
