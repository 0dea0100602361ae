"""The model of the p5: what the engine of chapters 07-15 would move there. No chapter uses
it; scripts/calibrate.py, scripts/journey.py and the notebooks do.

p5: the model (hardware, CPU costs per call, a chapter's layout -> throughput);
calibration: its parameters, calibrated on the series' p5 run; journey: the chapters'
figures side by side (the blog's, the model's, ours and yours); inputs: the blog's figures
and our measurements read from a results folder, for the scripts.
"""
