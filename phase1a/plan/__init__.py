"""The plan: calibration's measured trials, the time window, the options table, the estimate's footing,
interruptions on spot hosts, gradient communication between GPUs and nodes."""
