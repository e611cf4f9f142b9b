"""Console-script entry points (see setup.py)."""
