"""The run directory and its checkpoints. rundir.py knows a run's layout and is the only code that
creates, replaces or deletes anything in one (its readers need no torch); files.py writes and reads
what one checkpoint holds (safetensors weights, training.pt, meta.json); manager.py decides which
checkpoints exist, which is best, and saves and resumes through the trainer's state_dict. Training
writes here; translation and export only read."""
