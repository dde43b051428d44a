# The one place mori_torch's version is written: setup.py reads this file
# (without importing the package) and mori_torch/__init__.py re-exports it.
__version__ = "0.1.0"
