# The tests' stand-in for a Windows machine's Python, where tensorflow-text has no wheel: put first on
# every test process's path (tests/conftest.py), its import fails as a missing package's does.
raise ModuleNotFoundError("No module named 'tensorflow_text'", name="tensorflow_text")
