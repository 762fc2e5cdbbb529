"""Training: the Trainer (set-up and loop), the step, validation, weight averaging, and the run
folder (lock, resume point, stopping). `python -m audioclf.train` calls `trainer.fit`."""
