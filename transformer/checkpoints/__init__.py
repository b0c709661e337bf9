"""The run directory and its checkpoints. layout.py names what a run holds and reads its state.json;
rundir.py is the run's writer, the only code that creates, replaces or deletes anything in one;
format.py is the checkpoint format and its verification (no torch), files.py writes and loads a
checkpoint's files; manager.py decides which checkpoints exist, which is best, and saves and resumes
through the trainer's state_dict; lookup.py finds a run's checkpoint for inference, read-only, and
pins.py lets a reader hold it while pruning goes on; parent.py reads a fine-tuned run's parent.
Training writes here; translation and export only read (lookup.py, format.py, files.py).
"""
