"""The rule families of the contract catalog (``contracts/catalog.py`` gathers them)."""
