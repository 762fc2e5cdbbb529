"""Training: the Trainer (set-up and loop), the step, the optimizer and learning rate (optim),
validation, weight averaging, the run folder (lock, resume point, stopping), its logs
(train.log, metrics.csv, TensorBoard) and trackers. `python -m audioclf.train` calls
`trainer.fit`."""
