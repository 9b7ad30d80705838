"""tokenmill: exact tokens and loss masks from raw records, fed to PyTorch once each, resumably."""

__version__ = "0.1.0"
