"""Quantized weights: which scheme a layer runs (config.py), and the linear methods that run them
(fp8.py, w4a16.py; the unquantized one lives with the layers in models/layers/linear.py)."""
