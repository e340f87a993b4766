"""The pipeline tests run the command's actions in process (actions.execute): with the command's
logging, so what it writes on stdout and stderr (pipeline/log.py) is there to read."""
from __future__ import annotations

import pytest

from kvbatch.pipeline.log import configure_command, unconfigure_command


@pytest.fixture(autouse=True)
def command_logging():
    """The command's logging for each test, removed after it."""
    configure_command()
    yield
    unconfigure_command()
