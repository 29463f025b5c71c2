"""Decoders (block-diffusion acceptance rules) behind one protocol (base.py), found through
registry.py; knob names and ranges in knobs.py (torch-free, read by config validation)."""
