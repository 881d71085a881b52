"""The training engine that tasks/ uses: one loop (engine.fit) for fine-tuning and pretraining, and its parts (the
step, batches, precision, optimizer and schedule, checkpoints and the run folder, metrics, torchrun). It knows no task:
a task passes in its data, model and loss. Floors: run_*.py -> tasks/ -> training/ -> models/ -> modules/."""
