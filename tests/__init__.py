"""kvserve's test suite: fixtures in conftest.py, helpers shared by several test files in
helpers.py (the only module of tests/ a test file imports)."""
