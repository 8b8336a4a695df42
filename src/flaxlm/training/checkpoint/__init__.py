"""Checkpoints: `manager` saves and restores (train state, loader position, metadata) by step
under a run's checkpoints/ folder, atomically, and reads a checkpoint's parameters back;
`resume` is what a train loop puts into each checkpoint and how a stopped run continues from
its latest one."""
