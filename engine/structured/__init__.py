"""Structured outputs: grammar compilation (`grammar`) and token masks (`mask`), via llguidance."""
