"""The engine thread's loop: its inbox, one tick, the events out, and the state a loaded model keeps."""
