"""Training: run.py builds a run (data, model, optimizer, trainer) from a config; trainer.py is the
loop; state.py what a run knows between steps (and how a resume mends it); loss.py, optim.py (Adam
and the schedules), budget.py (budgets as steps), averaging.py (the weights' moving average),
validation.py (loss, BLEU/chrF), precision_choice.py (`precision: auto`, decided by timing a few
steps), reporting.py (the progress bar, log lines and TensorBoard of a session), distributed.py
(torchrun helpers), logs.py (logging and the TensorBoard writer) and allocator.py (glibc malloc
tuning) serve it. Files in the run directory are written through checkpoints/, never from here."""
