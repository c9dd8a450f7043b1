"""The tests' support package: models and their plain-PyTorch references, the rank pool and its
fork server, the simulated device's scenarios, fault injection and the docs' code blocks. Tests
import it as ``support.<module>`` (``tests/`` is first on ``sys.path``, see ``conftest.py``)."""
