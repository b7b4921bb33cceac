"""Helpers shared by several test files (conftest.py holds the fixtures)."""
