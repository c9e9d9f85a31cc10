"""The one config schema (schema.py), its generated reference (reference.py), and the stores a config names."""
