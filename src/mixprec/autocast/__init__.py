"""What runs inside ``mp.autocast()``: portable op lists, the measured op plan, compiled models."""
