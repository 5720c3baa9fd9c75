"""The trainer (`python -m train`) will live here."""
