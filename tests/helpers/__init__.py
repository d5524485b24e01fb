"""Test helpers shared by several test modules (a package: `from helpers import ...`)."""
