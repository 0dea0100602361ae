"""scripts/chaos.py's parts: its processes and their watch (procs), its faults and the bounds
they are judged by (faults), its trials (trials)."""
