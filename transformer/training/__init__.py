"""Training: run.py builds a run (data, model, optimizer, trainer) from a config; trainer.py is the
loop and its resumable state; loss.py, optim.py (Adam and the schedules), budget.py (budgets as
steps), validation.py (loss, BLEU/chrF), distributed.py (torchrun helpers), logs.py (log lines and
TensorBoard) and allocator.py (glibc malloc tuning) serve it. Files in the run directory are
written through checkpoints/, never from here."""
