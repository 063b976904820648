"""Process trees a module-scoped fixture keeps across its module's tests (the
Ray cluster of tests/e2e/test_ray.py): the per-test orphan check in
tests/conftest.py leaves their descendants alone (Ray starts and keeps its own
worker processes while a test runs), and the fixture that started them ends
them at the module's end."""

from __future__ import annotations

HELD_ROOTS: set[int] = set()
