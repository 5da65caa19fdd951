"""mixprec: mixed-precision training for PyTorch."""
