"""GPU placement, the phase plan with its memory, and the handoffs that follow it."""
