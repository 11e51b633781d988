"""What the test modules share: builders of data and runs, process and namespace tools, the fork server, and the
programs the multi-process tests start (``python -m tests.helpers.NAME``). A test module imports from here, never
from another test module (``lint-imports``, .importlinter)."""
