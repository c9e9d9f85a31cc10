"""Where a run starts (the start stage): its trainable weights (`method.init_from`, warmstart.py) and, on a warm
start, the old data replayed beside the new (`method.replay_fraction`, replay.py)."""
