"""Helpers and fixtures shared by the tests (and nothing else): test modules import these, never each other.

Fixture modules are registered as pytest plugins in tests/conftest.py, so a test only names the fixture.
"""
